"""Deployments of `train`, `evaluate` and `sweep` served against the configured Prefect API, so runs can be started
from the UI (with typed parameters) and scheduled.

Each deployment names its flow by module and name (`flows.train.train`, Prefect's module-path entrypoint), so the
runner starts each run as `python -m prefect.engine`, which imports the flow, as a worker runs a deployment:
nothing of the serving process (a module global, the sweep's lock) is copied into the run."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from prefect import Flow

from areal_pipeline import shutdown

from flows.evaluate import evaluate
from flows.sweep import sweep
from flows.train import train


def deployments(config_path: str, overrides: list[str], run_id: Optional[str], iterations: Optional[int],
                cron: Optional[str] = None, interval: Optional[float] = None,
                eval_cron: Optional[str] = None, eval_interval: Optional[float] = None) -> list[tuple[Flow, dict]]:
    """A scheduled train run continues the same run id from its newest checkpoint for `iterations` more
    iterations; a scheduled evaluate run scores the run's newest checkpoint. A sweep run (the UI's Run, with the
    axes to add, e.g. `trainer.optimizer.lr=1e-3,5e-4`) starts a train run per combination, the served overrides
    fixed in every one. Each as (flow, keyword arguments of `flow.to_deployment`)."""
    config_path = str(Path(config_path).resolve())
    common = {"config_path": config_path, "overrides": overrides, "run_id": run_id}
    train_deployment = dict(
        name="train", parameters={**common, "iterations": iterations}, cron=cron, interval=interval,
        description="RL training: one child flow run per iteration (rollout -> advantages -> ppo_update -> "
                    "broadcast_weights -> checkpoint -> evaluate)")
    evaluate_deployment = dict(
        name="evaluate", parameters={**common, "checkpoint": "latest"}, cron=eval_cron, interval=eval_interval,
        description="pass@1 and mean reward of a checkpoint (default: the run's newest) on the test split")
    # the served overrides are the sweep's single-valued axes; its run ids are the run id followed by the values
    fixed = [o for o in overrides if o.partition("=")[0].strip() != "run_id"]
    named = [o.partition("=")[2].strip() for o in overrides if o.partition("=")[0].strip() == "run_id"]
    sweep_deployment = dict(
        name="sweep", parameters={"config_path": config_path, "axes": fixed, "iterations": iterations,
                                  "run_id": run_id or next(iter(named), None), "max_parallel": 1},
        description="a train run per combination of axes (key=v1,v2,...: add the keys to sweep), at most "
                    "max_parallel at once, each its own run id and flow run; a table artifact of their figures")
    return [(train, train_deployment), (evaluate, evaluate_deployment), (sweep, sweep_deployment)]


DEFAULT_POLL_SECONDS = 2.0  # a run started from the UI begins within this (Prefect's default: 10 s)
# After a stop signal the runs this process started get SIGTERM, then SIGKILL if still there after this: a run
# reports its end to the API first, which with the API gone would take minutes.
RUNS_STOP_GRACE_S = 5.0


def stop_started_runs(grace: float = RUNS_STOP_GRACE_S) -> None:
    """SIGTERM to every process this one started (the runner's flow-run processes and theirs), then SIGKILL to
    those still there after `grace`."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(children, timeout=grace)
    for child in alive:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass


def serve_deployments(*args, poll_seconds: Optional[float] = None, **kwargs) -> None:
    """What `prefect.serve` does, with a runner that asks the API for runs to start every `poll_seconds` (default:
    PREFECT_RUNNER_POLL_FREQUENCY where set, else `DEFAULT_POLL_SECONDS`)."""
    import asyncio

    from prefect.exceptions import TerminationSignal
    from prefect.runner import Runner
    from prefect.settings import get_current_settings
    from prefect.types.entrypoint import EntrypointType
    if poll_seconds is None and not os.environ.get("PREFECT_RUNNER_POLL_FREQUENCY"):
        poll_seconds = DEFAULT_POLL_SECONDS
    runner = Runner(pause_on_shutdown=True, query_seconds=poll_seconds)
    served = []
    for flow, arguments in deployments(*args, **kwargs):
        deployment = flow.to_deployment(**arguments, entrypoint_type=EntrypointType.MODULE_PATH)
        # run by this runner, not a work pool's worker (as `Runner.add_flow` sets it)
        deployment.work_pool_name = deployment.work_queue_name = None
        runner.add_deployment(deployment)
        served.append(f"{flow.name}/{arguments['name']}")
    ui = get_current_settings().ui_url
    print(f"Serving {', '.join(served)}: start a run from the Prefect UI{f' ({ui}/deployments)' if ui else ''} or "
          f"with `prefect deployment run {served[0]}`; Ctrl-C stops serving.", flush=True)
    # The runner's own SIGTERM handler takes over from the command's while it serves, and its shutdown talks to
    # the API; the command's stop still starts at the signal (areal_pipeline/shutdown.py), stopping the runs
    # and ending the process within FORCED_EXIT_AFTER_S, the API there or not.
    stopping = shutdown.register("the runs serve started", stop_started_runs)
    try:
        asyncio.run(runner.start())
    except (KeyboardInterrupt, TerminationSignal) as stop:
        print(f"{type(stop).__name__}: no longer serving", flush=True)
    finally:
        shutdown.unregister(stopping)
