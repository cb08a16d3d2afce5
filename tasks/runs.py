"""The live train runs of this process, by run id: one record per run holding everything the flows keep about it
while it runs (its pipeline, its context, and the flows' bookkeeping: iteration handoffs, progress, Prefect
control, events), so that a flow run finds its run by the run id in its parameters.

A node finds its pipeline by the run context it is handed (`pipeline_for`): the live one where the run is live in
this process (the flow's own: nothing is rebuilt), else one attached to the run's services (areal_pipeline/
run_context.py), made once per process and run and closed when the process exits."""

from __future__ import annotations

import atexit
import contextlib
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from areal_pipeline.pipeline import Pipeline
from areal_pipeline.run_context import RunContext, attach
from areal_pipeline.run_dir import run_is_locked


@dataclass
class LiveRun:
    pipeline: Pipeline
    handoffs: dict[int, Any] = field(default_factory=dict)  # iteration -> flows.overlap.Handoff
    progress: Optional[Any] = None  # flows.artifacts.Progress, while the iterations run
    control: Optional[Any] = None  # flows.control.RunControl: Prefect's cancel and pause of the train flow run
    events: Optional[Any] = None  # flows.events.RunEvents
    trackers: Optional[Any] = None  # areal_pipeline.trackers.Trackers: W&B, MLflow, TensorBoard (flows/tracking.py)
    artifacts: Optional[Any] = None  # flows.artifacts.RunArtifacts: the run's live table and curves
    artifacts_published_at: float = -math.inf  # when its last iteration card was published (monotonic)
    last_card: Optional[int] = None  # the iteration of that card (None: no card yet in this command)
    tags: tuple[str, ...] = ()  # the Prefect tags of its flow runs (flows/labels.py)
    # what its nodes are handed (RunContext.to_dict()), once its services are up (flows/train.py)
    context: Optional[dict] = None
    # what holds while the run is live and is undone when it ends (its judge's share of the Prefect limit)
    scopes: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def run_id(self) -> str:
        return self.pipeline.cfg.run_id


_LIVE: dict[str, LiveRun] = {}


def register(pipeline: Pipeline) -> LiveRun:
    if pipeline.cfg.run_id in _LIVE:
        raise RuntimeError(f"run '{pipeline.cfg.run_id}' is already live in this process")
    run = _LIVE[pipeline.cfg.run_id] = LiveRun(pipeline)
    hold_the_judge_limit(pipeline, run.scopes)
    return run


def hold_the_judge_limit(pipeline: Pipeline, scopes: contextlib.ExitStack) -> None:
    """Where `pipeline` has a group reward, its judge's calls share the Prefect server's limit with every other run
    and re-scoring on it, until `scopes` closes."""
    if pipeline.cfg.rollout.group_reward:
        from tasks.judge_limit import shared_judge_limit

        scopes.enter_context(shared_judge_limit())


def unregister(run_id: str) -> None:
    run = _LIVE.pop(run_id, None)
    if run is not None:
        run.scopes.close()


def find(run_id: str) -> Optional[LiveRun]:
    return _LIVE.get(run_id)


def get(run_id: str) -> LiveRun:
    run = _LIVE.get(run_id)
    if run is None:
        raise RuntimeError(f"run '{run_id}' is not live in this process (its flow runs run in the process of its "
                           "train flow, which starts the servers and the trainer)")
    return run


_ATTACHED: dict[str, tuple[RunContext, Pipeline, contextlib.ExitStack]] = {}
_ATTACHED_LOCK = threading.Lock()


def pipeline_for(context: RunContext) -> Pipeline:
    """The pipeline that runs a node of the run `context` names: the run's live one in this process, else one
    attached to the run's services (made on first use; one made for another context of the run is closed), which
    holds the judge's Prefect limit as the live one does."""
    live = _LIVE.get(context.run_id)
    if live is not None and str(live.pipeline.paths.run_dir.resolve()) == context.run_dir:
        return live.pipeline
    with _ATTACHED_LOCK:
        found = _ATTACHED.get(context.run_id)
        if found is not None and found[0] == context:
            return found[1]
        if found is not None:
            _close(*found[1:])
        pipeline, scopes = attach(context), contextlib.ExitStack()
        hold_the_judge_limit(pipeline, scopes)
        _ATTACHED[context.run_id] = (context, pipeline, scopes)
        return pipeline


def close_attached() -> None:
    """Close this process's attached pipelines (their journals' writers, reward workers); their services go on."""
    with _ATTACHED_LOCK:
        attached = [found[1:] for found in _ATTACHED.values()]
        _ATTACHED.clear()
    for pipeline, scopes in attached:
        _close(pipeline, scopes)


def _close(pipeline: Pipeline, scopes: contextlib.ExitStack) -> None:
    try:
        pipeline.close()
        pipeline.services.stop()
    finally:
        scopes.close()


atexit.register(close_attached)


def goes_on(context: RunContext) -> bool:
    """Whether the run goes on: where it is live in this process, until its services are stopped (the run is
    ending); elsewhere, while a process holds the run's lock (its train flow) and this process is not stopping."""
    live = _LIVE.get(context.run_id)
    if live is not None:
        return not live.pipeline.services.stopped
    attached = _ATTACHED.get(context.run_id)
    if attached is not None and attached[1].services.stopped:
        return False
    return run_is_locked(Path(context.run_dir))
