"""What a person finds a run by in Prefect's UI: the `train` flow run named after the run id, and tags on it and
on its iteration runs,

    run:<run id>   config:<config file stem>   workflow:<rollout.workflow>   branch-of:<parent run id> (a branch)
    branch-at:<K> (a branch)   rescored:<name> (a replay on re-scored rollouts)

so that the flow-run search by tag `run:<id>` finds the train run and its `<id>/iter-<k>` runs together.
"""

from __future__ import annotations

import contextlib
import contextvars
from pathlib import Path
from typing import Any, Iterator, Optional

from prefect import runtime

from areal_pipeline import shutdown
from areal_pipeline.branching import read_branch
from areal_pipeline.config import ExperimentConfig
from areal_pipeline.run_spec import run_id_of

DEFAULT_CONFIG = "configs/tiny_cpu.yaml"  # the `train` flow's default config_path


def train_run_name() -> str:
    """The `train` flow's `flow_run_name`: the run id its parameters resolve to (the `run_id` parameter, else the
    config file and overrides, read without loading the config)."""
    parameters = runtime.flow_run.parameters
    config_path = parameters.get("config_path") or DEFAULT_CONFIG
    try:
        return run_id_of(config_path, parameters.get("overrides"), parameters.get("run_id"))
    except Exception:  # noqa: BLE001  the body reports a bad config with its reason: naming never raises
        return f"train {Path(str(config_path)).stem}"


def evaluate_run_name() -> str:
    """The `evaluate` flow's `flow_run_name`: `<run id>/evaluate` (the run id as `train_run_name` resolves it)."""
    parameters = runtime.flow_run.parameters
    config_path = parameters.get("config_path") or DEFAULT_CONFIG
    try:
        return f"{run_id_of(config_path, parameters.get('overrides'), parameters.get('run_id'))}/evaluate"
    except Exception:  # noqa: BLE001  the body reports a bad config with its reason: naming never raises
        return f"evaluate {Path(str(config_path)).stem}"


def run_tags(cfg: ExperimentConfig, config_path: str) -> tuple[str, ...]:
    tags = [f"run:{cfg.run_id}", f"config:{Path(str(config_path)).stem}", f"workflow:{cfg.rollout.workflow}"]
    branch = read_branch(cfg.run_dir)  # written by the branch flow before its train run starts
    if branch is not None:
        tags += [f"branch-of:{branch['parent_run_id']}", f"branch-at:{branch['at']}"]
        if branch.get("rescored_from"):
            tags.append(f"rescored:{branch['rescored_from']['name']}")
    return tuple(tags)


def label_train_run(cfg: ExperimentConfig, config_path: str) -> tuple[str, ...]:
    """Name the current `train` flow run after the run id, add the run's tags, and fill in the run id it resolved;
    the tags, for its iteration runs.

    The run id came from the config or an override when the `run_id` parameter is null, and the UI shows the
    parameters as given. Filling it in is what the run resolved anyway: `load_run` applies the `run_id` parameter
    as the last override, so a Retry of this flow run with the filled-in parameters trains the very same run. A
    null is replaced only: a run id given as the parameter is left as it is."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    flow_run = FlowRunContext.get().flow_run
    tags = run_tags(cfg, config_path)
    parameters: Optional[dict[str, Any]] = None
    if flow_run.parameters.get("run_id") is None:
        parameters = {**flow_run.parameters, "run_id": cfg.run_id}
    with get_client(sync_client=True) as client:
        client.update_flow_run(flow_run.id, name=cfg.run_id, tags=sorted({*flow_run.tags, *tags}),
                               parameters=parameters)
    return tags


def tag_iteration_run(tags: tuple[str, ...]) -> None:
    """Add the run's tags to the current (iteration, evaluate) flow run. Not through `prefect.tags(...)` around the iteration
    calls: that context tags every task run created inside it too, and a tagged task run takes and releases a
    tag concurrency slot through the API around each node."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    flow_run = FlowRunContext.get().flow_run
    if set(tags) <= set(flow_run.tags):  # a retried run, tagged the first time
        return
    with get_client(sync_client=True) as client:
        client.update_flow_run(flow_run.id, tags=sorted({*flow_run.tags, *tags}))


LEFTOVER_STATES = ("RUNNING", "PENDING", "CANCELLING")


def _unfinished() -> Any:
    """The filter of flow runs in one of LEFTOVER_STATES."""
    from prefect.client.schemas.filters import FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType

    return FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType[s] for s in LEFTOVER_STATES]))


def crash_leftover_runs(run_id: str) -> list[str]:
    """Flow runs of run `run_id` (tagged `run:<id>`) that the API shows Running, Pending or Cancelling while this
    process holds the run's lock: their process was killed (no other process can be running the run), so the UI
    would show them running until someone retried them. Each is marked Crashed, naming this flow run; this flow
    run and the runs above it are left alone. Returns their names."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.context import FlowRunContext
    from prefect.states import Crashed

    here = FlowRunContext.get().flow_run
    with get_client(sync_client=True) as client:
        ours, run = {here.id}, here
        while run.parent_task_run_id is not None:  # this run's parents (a branch, a firing, a sweep)
            task_run = client.read_task_run(run.parent_task_run_id)
            if task_run.flow_run_id is None:
                break
            run = client.read_flow_run(task_run.flow_run_id)
            ours.add(run.id)
        found = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"run:{run_id}"]),
                                                                    state=_unfinished()))
        crashed = []
        for leftover in found:
            if leftover.id in ours:
                continue
            client.set_flow_run_state(leftover.id, Crashed(
                message=f"its process is gone: run {run_id} was started again by flow run {here.name} ({here.id})"),
                force=True)
            crashed.append(leftover.name)
    return crashed


def crash_unfinished_runs(client: Any, flow_run: Any, why: str) -> list[str]:
    """`flow_run` (as the API last gave it) and the runs below it that the API still shows Running, Pending or
    Cancelling, marked Crashed with `why`, where the process running them ended, or is being forced to end, before
    Prefect recorded their crash (a sweep's killed run, a forced exit after a stop signal); the UI would otherwise
    show them running. Returns their names."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.states import Crashed

    if flow_run.state is not None and flow_run.state.type.value not in LEFTOVER_STATES:
        return []  # it ended as a run ends: so did the runs below it, first
    runs, level = [flow_run], [flow_run.id]
    while level:  # the unfinished runs below, level by level (an iteration's evaluation under the iteration, ...)
        below = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=level), state=_unfinished()))
        runs += below
        level = [run.id for run in below]
    for run in runs:
        client.set_flow_run_state(run.id, Crashed(message=why), force=True)
    return [run.name for run in runs]


@contextlib.contextmanager
def quick_client(timeout_s: float = 2.0) -> Iterator[Any]:
    """A sync Prefect client of its own whose calls neither retry nor wait longer than `timeout_s`: for what a
    stopping process still records, where the API may be what is gone and nothing may wait on it."""
    from prefect import get_client
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    # the time-out as httpx settings: with settings of its own, get_client does not hand back the client the flow
    # run's context holds, which the thread held up in the stop may be using
    with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 0}), \
            get_client(sync_client=True, httpx_settings={"timeout": timeout_s}) as client:
        yield client


# The flow run whose block (`crashed_if_forced_to_exit`) this context is in: a flow run below it in this process
# (a firing's train run) is among the runs that block's report marks already.
_reporting_for: contextvars.ContextVar[Any] = contextvars.ContextVar("reporting_for", default=None)


@contextlib.contextmanager
def crashed_if_forced_to_exit(flow_run_id: Any) -> Iterator[None]:
    """While the block runs, a forced exit after a stop signal (areal_pipeline/shutdown.py) first marks the flow
    run and the unfinished runs below it Crashed: the exit cuts short the unwinding in which Prefect's engine would
    have recorded the crash, and the UI would show them running until the run id was started again. Within another
    such block (a firing's train run) it adds nothing: the outer block's report marks this run too."""
    if _reporting_for.get() is not None:
        yield
        return
    token = _reporting_for.set(flow_run_id)
    settings = contextvars.copy_context()  # the API this flow run talks to (a temporary server's URL is set there)

    def report() -> None:
        def crash() -> None:
            with quick_client() as client:
                crash_unfinished_runs(client, client.read_flow_run(flow_run_id),
                                      "its process was forced to exit after a stop signal, before recording its end")
        settings.run(crash)

    handle = shutdown.register_final_report(f"flow run {flow_run_id}'s crash", report)
    try:
        yield
    finally:
        shutdown.unregister(handle)
        _reporting_for.reset(token)
