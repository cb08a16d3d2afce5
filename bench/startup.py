"""Start-up of a training run as a user starts it: `areal-pipeline train`, from the command's start to its first
iteration, with the services forked from a preloaded forkserver (areal_pipeline/forkserver.py: "forked"), without
it (`AREAL_FORKSERVER=0`: each service imports torch and transformers itself, the trainer under torchrun:
"launched").

    python bench/startup.py [--config configs/tiny_cpu.yaml] [--rounds 2] [--api-url URL] [key=value ...]

Each round runs both settings (ABBA order across rounds, as this machine's speed drifts), a 1-iteration run each,
on an embedded model built before any clock starts. The phases come from the run's log, relative to the command's
start: Prefect API ready, flow run begun, inference servers ready, first iteration begun; then the whole command.
`--api-url` runs against a standing Prefect server (else each run starts its temporary one).
The last line is one JSON object of the figures (medians over rounds).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PHASES = {  # log line -> phase
    "api_ready": re.compile(r"Prefect API: temporary server"),
    "flow_begun": re.compile(r"Beginning flow run .* for flow 'train'"),
    "servers_ready": re.compile(r"inference servers ready"),
    "first_iteration": re.compile(r"Beginning subflow run '[^']*/iter-1'"),
}


def one_run(cli: str, config: str, overrides: list[str], run_id: str, env: dict) -> dict:
    started = time.time()
    # --verbose: the log records the phases are read from, on the terminal (else they go to the run's log file)
    done = subprocess.run([cli, "train", "--verbose", "--config", config, f"run_id={run_id}", "total_iterations=1",
                           "eval_freq=0", *overrides], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    wall = time.time() - started
    if done.returncode != 0:
        raise SystemExit(f"the run failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    phases = {}
    for line in (done.stdout + done.stderr).splitlines():
        for phase, pattern in PHASES.items():
            if phase not in phases and pattern.search(line) and line[:4].isdigit():
                at = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
                phases[phase] = round(at - started, 2)
    return {**phases, "command_seconds": round(wall, 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--api-url", default="", help="a standing Prefect server's API (default: a temporary one a run)")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    from areal_pipeline.model import resolve_model_path
    from areal_pipeline.run_spec import load_config

    work = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    overrides = [f"output_dir={work}", *args.overrides]
    cfg = load_config(args.config, overrides)
    resolve_model_path(cfg.model, cfg.output_dir, cfg.seed)
    cli = str(Path(sys.executable).with_name("areal-pipeline"))
    env = dict(os.environ)
    env.pop("PREFECT_API_URL", None)
    if args.api_url:
        env["PREFECT_API_URL"] = args.api_url
    settings = {"forked": {**env, "AREAL_FORKSERVER": "1"}, "launched": {**env, "AREAL_FORKSERVER": "0"}}
    runs = _rounds(cli, args, overrides, settings)
    result = {"rounds": args.rounds, "api": "standing" if args.api_url else "temporary"}
    for name, figures in runs.items():
        for key in [*PHASES, "command_seconds"]:
            values = [f[key] for f in figures if key in f]
            if values:
                result[f"{name}_{key}"] = round(statistics.median(values), 2)
    if result.get("launched_first_iteration") and result.get("forked_first_iteration"):
        result["startup_launched_vs_forked"] = round(
            result["launched_first_iteration"] / result["forked_first_iteration"], 2)
    print(json.dumps(result))


def _rounds(cli: str, args, overrides: list[str], settings: dict[str, dict]) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {name: [] for name in settings}
    for r in range(args.rounds):
        order = list(settings) if r % 2 == 0 else list(settings)[::-1]
        for name in order:
            figures = one_run(cli, args.config, overrides, f"{name}-{r}", settings[name])
            runs[name].append(figures)
            print(f"round {r} {name:8s} " + "  ".join(f"{k} {v}" for k, v in figures.items()), flush=True)
    return runs


if __name__ == "__main__":
    main()
