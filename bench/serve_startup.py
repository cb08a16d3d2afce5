"""Start-up of a run started from the Prefect UI: `areal-pipeline serve` against a Prefect API, a deployment run
created as the UI's Run button creates it, timed on the API's clock from its creation to its first iteration.

    python bench/serve_startup.py [--config configs/tiny_cpu.yaml] [--runs 3] [--worker] [key=value ...]

`--worker`: the deployment on a process work pool (prefect.yaml's, `prefect deploy`) and a `prefect worker start`
instead of `serve`, each run Prefect's own command (`python -m prefect.engine`).

Each run is a new `serve` process (or worker) and a 1-iteration `train` of its own run id, on an embedded model built
before any clock starts, against a temporary Prefect API server the bench starts (SQLite, a private PREFECT_HOME);
`serve`'s runner spawns each run as a new interpreter. Phases from the API: `picked_up` (the runner set the run
Pending: its poll), `began` (the run's process set it Running: after its imports), `first_iteration` (the first
iteration's flow run began); each relative to the run's creation. The last line is one JSON object of the figures
(medians).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


async def _one_run(deployment_name: str, run_id: str, parameters: dict) -> dict:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    async with get_client() as client:
        for _ in range(600):
            try:
                deployment = await client.read_deployment_by_name(deployment_name)
                break
            except Exception:
                await asyncio.sleep(0.2)
        run = await client.create_flow_run_from_deployment(deployment.id, parameters={"run_id": run_id, **parameters})
        created = run.created
        while True:
            run = await client.read_flow_run(run.id)
            if run.state.is_final():
                break
            await asyncio.sleep(0.2)
        if not run.state.is_completed():
            raise SystemExit(f"run {run_id} ended {run.state.name}: {run.state.message}")
        states = await client.read_flow_run_states(run.id)
        children = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run.id])))
    at = {s.type.value: s.timestamp for s in reversed(states)}  # each state type's first time
    first_iteration = min(c.start_time for c in children if c.name.endswith("iter-1") and c.start_time)
    return {"picked_up": (at["PENDING"] - created).total_seconds(),
            "began": (at["RUNNING"] - created).total_seconds(),
            "first_iteration": (first_iteration - created).total_seconds(),
            "ended": (run.end_time - created).total_seconds()}


def _serve(cli: str, args, env: dict, work: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([cli, "serve", "--config", args.config, "--iterations", "1", f"output_dir={work}",
                             "total_iterations=1", "eval_freq=0", *args.overrides], cwd=REPO, env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def _worker(cli: str, env: dict, work: Path, log: Path) -> subprocess.Popen:
    """The train deployment (re)deployed to a process pool, and a worker of that pool."""
    prefect = str(Path(cli).with_name("prefect"))
    pool = "bench-worker"
    subprocess.run([prefect, "work-pool", "create", pool, "--type", "process", "--overwrite"], cwd=REPO, env=env,
                   check=True, capture_output=True)
    subprocess.run([prefect, "--no-prompt", "deploy", "--name", "train", "--pool", pool], cwd=REPO,
                   env=env, check=True, capture_output=True)
    return subprocess.Popen([prefect, "worker", "start", "--pool", pool], cwd=work,
                            env={**env, "PREFECT_WORKER_QUERY_SECONDS": "1"}, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--worker", action="store_true", help="a process work pool's worker instead of serve")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    from areal_pipeline.model import resolve_model_path
    from areal_pipeline.run_spec import load_config
    from flows.api_server import TemporaryAPIServer

    cfg = load_config(args.config, [f"output_dir={work}", *args.overrides])
    resolve_model_path(cfg.model, cfg.output_dir, cfg.seed)
    cli = str(Path(sys.executable).with_name("areal-pipeline"))
    os.environ["PREFECT_HOME"] = str(work / "prefect-home")
    api = TemporaryAPIServer()  # the Prefect API that `serve` and this process (creating the runs) talk to
    os.environ["PREFECT_API_URL"] = api.url
    env = dict(os.environ)
    figures: list[dict] = []
    try:
        api.wait_ready()
        for r in range(args.runs):
            log = work / f"serve-{r}.log"
            if args.worker:  # the worker polls every second: serve's --poll-seconds default is 2
                serve = _worker(cli, env, work, log)
            else:
                serve = _serve(cli, args, env, work, log)  # the model built is under work/_models
            try:
                # serve: its deployments registered, its runner polling next; a worker: polling from here on
                while (" started!" if args.worker else "Serving ") not in log.read_text():
                    if serve.poll() is not None:
                        raise SystemExit(f"serve exited: {log.read_text()[-3000:]}")
                    time.sleep(0.2)
                time.sleep(1.0)
                parameters = {"iterations": 1, "config_path": args.config,
                              "overrides": [f"output_dir={work}", "total_iterations=1", "eval_freq=0",
                                            *args.overrides]} if args.worker else {}
                one = asyncio.run(_one_run("train/train", f"run-{r}", parameters))
            finally:
                os.killpg(serve.pid, signal.SIGINT)
                serve.wait(60)
            figures.append(one)
            print(f"run {r} " + "  ".join(f"{k} {v:.2f}" for k, v in one.items()), flush=True)
    finally:
        api.stop()
    result = {"runs": args.runs, "runner": "worker" if args.worker else "serve"}
    for key in figures[0]:
        result[key] = round(statistics.median(r[key] for r in figures), 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
