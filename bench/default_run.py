"""The default run's speed against an earlier revision, the two run in alternation on one machine: each node's
seconds and each iteration's wall time of `areal-pipeline train --config configs/tiny_cpu.yaml`.

    python bench/default_run.py [--against 63aedea] [--iterations 40] [--rounds 2] [overrides ...]

Each revision runs from a git worktree of its own (`PYTHONPATH` puts its packages first, for the command and for
the servers and trainer it starts), with a temporary Prefect API as `make run` has it. The revisions alternate
within each round, so that a change in the machine's load falls on both. A revision's first run builds its embedded
model (outside the figures: they start at iteration 2). Figures, medians over iterations 2..N of every run of a
revision: each node's seconds (`time_*` in metrics.jsonl, the library's work without orchestration) and the
iteration's wall time (between two iterations' report lines in train.log, orchestration included); the rewards of
the revisions' runs, which the seeds make equal where nothing changed the episodes. The last line is one JSON
object: each revision's medians and `ratio` (this checkout's over the other's, < 1: faster now).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_AGAINST = "63aedea"  # after #34, before #35 (the episode journal) and the failure policy
REPORT = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) .*: iteration (\d+): reward")  # train.log's lines


def worktree(revision: str, root: Path) -> Path:
    path = root / revision.replace("/", "_")
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--force", str(path), revision],
                   check=True, capture_output=True, text=True)
    return path


def run_once(source: Path, work: Path, run_id: str, iterations: int, overrides: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(source)}
    env.pop("PREFECT_API_URL", None)  # the command's own temporary API, as `make run` has it
    command = [sys.executable, "-c", "import sys; from cli import main; sys.exit(main())", "train",
               "--config", str(source / "configs/tiny_cpu.yaml"), f"output_dir={work}", f"run_id={run_id}",
               f"total_iterations={iterations}", *overrides]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=source, env=env, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{source.name}: train failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    run_dir = work / run_id
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    reported = {}
    for line in (run_dir / "logs" / "train.log").read_text().splitlines():
        match = REPORT.search(line)
        if match:
            reported[int(match.group(2))] = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S,%f")
    walls = [(reported[k] - reported[k - 1]).total_seconds() for k in sorted(reported) if k - 1 in reported]
    nodes = sorted({key for r in records for key in r if key.startswith("time_")})
    return {"command_s": round(wall, 2), "iteration_wall_s": walls,
            "nodes": {key[5:]: [r[key] for r in records[1:] if r.get(key) is not None] for key in nodes},
            "rewards": [round(r["reward_mean"], 4) for r in records]}


def medians(runs: list[dict]) -> dict:
    nodes = sorted({n for run in runs for n in run["nodes"]})
    return {"iteration_wall_s": round(statistics.median([w for run in runs for w in run["iteration_wall_s"]]), 4),
            **{f"{n}_s": round(statistics.median([s for run in runs for s in run["nodes"].get(n, [])]), 4)
               for n in nodes if any(run["nodes"].get(n) for run in runs)},
            "command_s": [run["command_s"] for run in runs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default=DEFAULT_AGAINST, help="the earlier revision")
    parser.add_argument("--iterations", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("overrides", nargs="*", help="key=value, for both revisions' runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="default-run-") as tmp:
        root = Path(tmp)
        sources = {"now": REPO, args.against: worktree(args.against, root)}
        runs: dict[str, list[dict]] = {name: [] for name in sources}
        try:
            for round_ in range(args.rounds):
                order = list(sources) if round_ % 2 == 0 else list(reversed(sources))
                for name in order:
                    run = run_once(sources[name], root / f"work-{name}", f"r{round_}", args.iterations, args.overrides)
                    runs[name].append(run)
                    print(f"round {round_ + 1} {name}: command {run['command_s']} s, iteration wall median "
                          f"{statistics.median(run['iteration_wall_s']):.3f} s, "
                          + ", ".join(f"{n} {statistics.median(v):.3f}" for n, v in run["nodes"].items() if v),
                          flush=True)
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(sources[args.against])],
                           capture_output=True)
    figures = {name: medians(name_runs) for name, name_runs in runs.items()}
    now, other = figures["now"], figures[args.against]
    ratio = {key: round(now[key] / other[key], 3) for key in now
             if key in other and isinstance(now[key], float) and other[key]}
    same_rewards = all(a["rewards"] == b["rewards"] for a, b in zip(runs["now"], runs[args.against]))
    print(json.dumps({"against": args.against, "iterations": args.iterations, "rounds": args.rounds,
                      "medians": figures, "ratio": ratio, "same_rewards": same_rewards}))


if __name__ == "__main__":
    main()
