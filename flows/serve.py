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


def one_at_a_time():
    """A deployment's concurrency limit of one run: a run started while one runs waits for it (Prefect's ENQUEUE:
    AwaitingConcurrencySlot in the UI) rather than fail on the run's lock."""
    from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

    return ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE)


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
        concurrency_limit=one_at_a_time(),
        description="RL training: one child flow run per iteration (rollout -> advantages -> ppo_update -> "
                    "broadcast_weights -> checkpoint -> evaluate); one run at a time, the next waits its turn")
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


def line_deployments(config_path: str, overrides: list[str], cron: Optional[str] = None,
                     interval: Optional[float] = None) -> list[tuple[Flow, dict]]:
    """A recurring line's deployments, named after the line: `recurring/<line>` (its firings, on the schedule) and
    `recurring-rollback/<line>` (the UI's way to publish an earlier champion). One run of each at a time: a firing
    due while the last one runs waits for it in Prefect (and then for the line's lock)."""
    from areal_pipeline.recurring.line import line_name
    from areal_pipeline.run_spec import load_config
    from flows.recurring import recurring, recurring_rollback

    config_path = str(Path(config_path).resolve())
    name = line_name(load_config(config_path, overrides))
    common = {"config_path": config_path, "overrides": overrides}
    firing = dict(name=name, parameters=common, cron=cron, interval=interval, concurrency_limit=one_at_a_time(),
                  tags=[f"line:{name}", "recurring"],
                  description=f"a firing of line {name}: a candidate from the champion on the new rows, gated, "
                              "approved, promoted to the servers the line serves")
    rollback = dict(name=name, parameters={**common, "to": None}, concurrency_limit=one_at_a_time(),
                    tags=[f"line:{name}", "recurring"],
                    description=f"publish an earlier champion of line {name} again (to: its run id, or base)")
    return [(recurring, firing), (recurring_rollback, rollback)]


DEFAULT_POLL_SECONDS = 2.0  # a run started from the UI begins within this (Prefect's default: 10 s)
# After a stop signal the runs this process started get SIGTERM, then SIGKILL if still there after this: a run
# reports its end to the API first, which with the API gone would take minutes.
RUNS_STOP_GRACE_S = 5.0
# What is left of shutdown.FORCED_EXIT_AFTER_S after the grace, for marking the killed runs' ends in the API
END_RUNS_TIMEOUT_S = 2.0


def stop_started_runs(grace: float = RUNS_STOP_GRACE_S, end_timeout: float = END_RUNS_TIMEOUT_S) -> list[str]:
    """SIGTERM to every process this one started (the runner's flow-run processes and theirs), then SIGKILL to
    those still there after `grace`; then `end_stopped_runs` on their flow runs. Their flow runs' ids."""
    import psutil

    children = psutil.Process().children(recursive=True)
    flow_run_ids = flow_runs_of(children)
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
    if flow_run_ids:
        end_stopped_runs(flow_run_ids, end_timeout)
    return flow_run_ids


def flow_runs_of(processes) -> list[str]:
    """The ids of the flow runs `processes` run: Prefect's runner hands each run's process its id in
    PREFECT__FLOW_RUN_ID, which the processes that one starts inherit."""
    import psutil

    ids: list[str] = []
    for process in processes:
        try:
            flow_run_id = process.environ().get("PREFECT__FLOW_RUN_ID")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if flow_run_id and flow_run_id not in ids:
            ids.append(flow_run_id)
    return ids


def end_stopped_runs(flow_run_ids: list[str], timeout: float = END_RUNS_TIMEOUT_S) -> int:
    """Cancelled in the API, each of `flow_run_ids` that has not reported an end: a run whose process was killed
    before it could (the grace over, an API slow to answer) would stay Running, holding its deployment's
    one-at-a-time slot from every later run until Prefect's lease on the slot expires, minutes later. A state set
    by force still frees the slot. A run that ended on its own keeps its state. How many were marked; the API gone
    or slow: said, not waited for."""
    import uuid

    async def end() -> int:
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelled

        ended = 0
        async with get_client() as client:
            for flow_run_id in flow_run_ids:
                run = await client.read_flow_run(uuid.UUID(flow_run_id))
                if run.state is None or not run.state.is_final():
                    await client.set_flow_run_state(run.id, Cancelled(
                        message="`serve` stopped while this run ran, and stopped its process"), force=True)
                    ended += 1
        return ended

    ended = api_call_within(end, timeout)
    if isinstance(ended, Exception):
        print(f"could not mark the end of flow run(s) {', '.join(flow_run_ids)} ({type(ended).__name__}: "
              f"{ended}); Prefect frees their deployment's slot once its lease expires", flush=True)
        return 0
    if ended:
        print(f"marked {ended} flow run(s) whose process was stopped Cancelled", flush=True)
    return ended


def serve_deployments(*args, poll_seconds: Optional[float] = None, recurring: bool = False, **kwargs) -> None:
    """What `prefect.serve` does, with a runner that asks the API for runs to start every `poll_seconds` (default:
    PREFECT_RUNNER_POLL_FREQUENCY where set, else `DEFAULT_POLL_SECONDS`). `recurring`: a recurring line's
    deployments (`line_deployments`), and the servers the line runs itself while this serves."""
    import asyncio

    from prefect.exceptions import TerminationSignal
    from prefect.runner import Runner
    from prefect.settings import get_current_settings
    from prefect.types.entrypoint import EntrypointType
    if poll_seconds is None and not os.environ.get("PREFECT_RUNNER_POLL_FREQUENCY"):
        poll_seconds = DEFAULT_POLL_SECONDS
    runner = Runner(pause_on_shutdown=True, query_seconds=poll_seconds)
    served = []
    if recurring:
        config_path, overrides = args[0], args[1]
        planned = line_deployments(config_path, overrides, kwargs.get("cron"), kwargs.get("interval"))
    else:
        planned = deployments(*args, **kwargs)
    for flow, arguments in planned:
        deployment = flow.to_deployment(**arguments, entrypoint_type=EntrypointType.MODULE_PATH)
        # run by this runner, not a work pool's worker (as `Runner.add_flow` sets it)
        deployment.work_pool_name = deployment.work_queue_name = None
        runner.add_deployment(deployment)
        served.append(f"{flow.name}/{arguments['name']}")
    ui = get_current_settings().ui_url
    print(f"Serving {', '.join(served)}: start a run from the Prefect UI{f' ({ui}/deployments)' if ui else ''} or "
          f"with `prefect deployment run {served[0]}`; Ctrl-C stops serving.", flush=True)
    # The runner's own SIGTERM handler takes over from the command's while it serves, and its shutdown talks to
    # the API (Prefect 3.9's cancels the runs it started, which end Cancelled; 3.8's exited first and left them
    # Running); the command's stop still starts at the signal (areal_pipeline/shutdown.py), stopping the runs and
    # ending the process within FORCED_EXIT_AFTER_S, the API there or not.
    stopping = shutdown.register("the runs serve started", stop_started_runs)
    line_servers = None
    try:
        if recurring:
            from flows.line_servers import LineServers

            line_servers = LineServers.start(args[0], args[1])
        asyncio.run(runner.start())
    except (KeyboardInterrupt, TerminationSignal) as stop:
        print(f"{type(stop).__name__}: no longer serving", flush=True)
    finally:
        shutdown.unregister(stopping)
        if line_servers is not None:
            line_servers.stop()
        remove_schedules(served)


REMOVE_SCHEDULES_TIMEOUT_S = 10.0


def remove_schedules(served: list[str], timeout: float = REMOVE_SCHEDULES_TIMEOUT_S) -> None:
    """The served deployments' schedules are deleted when `serve` stops (the runner has paused them, which drops
    their scheduled runs): a schedule belongs to the `serve` that set it, and nothing else (a later `prefect deploy`
    of the same deployment, a worker) fires it once serving stopped. The API gone: said, not waited for."""

    async def remove() -> int:
        from prefect.client.orchestration import get_client

        removed = 0
        async with get_client() as client:
            for name in served:
                deployment = await client.read_deployment_by_name(name)
                for schedule in deployment.schedules:
                    await client.delete_deployment_schedule(deployment.id, schedule.id)
                    removed += 1
        return removed

    removed = api_call_within(remove, timeout)
    if isinstance(removed, Exception):
        print(f"could not remove the schedules of {', '.join(served)} ({type(removed).__name__}: {removed}); they "
              "stay paused", flush=True)
        return
    if removed:
        print(f"removed {removed} schedule(s) of {', '.join(served)}: `serve` sets them again when it starts",
              flush=True)


def api_call_within(call, timeout: float):
    """`call()`'s coroutine run to its end within `timeout` seconds: its result, or the exception that ended it
    (a time-out included); stopping `serve` warns and goes on, never hangs or raises. In a thread of its own, with the
    caller's Prefect settings: it may run in a signal handler, on the thread whose event loop runs the runner."""
    import asyncio
    import contextvars
    import threading

    outcome: list = []

    def run() -> None:
        try:
            outcome.append(asyncio.run(asyncio.wait_for(call(), timeout)))
        except Exception as error:
            outcome.append(error)

    thread = threading.Thread(target=contextvars.copy_context().run, args=(run,), name="serve-api-call",
                              daemon=True)
    thread.start()
    thread.join(timeout + 1.0)
    return outcome[0] if outcome else TimeoutError(f"no answer within {timeout:.0f} s")
