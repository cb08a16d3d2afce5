"""The live train runs of this process, by run id: one record per run holding everything the flows and tasks
keep about it while it runs (its pipeline, and the flows' bookkeeping: iteration handoffs, progress, Prefect
control, events), so that a node or a flow run finds its run by the run id in its parameters."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from areal_pipeline.pipeline import Pipeline


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
    if pipeline.cfg.rollout.group_reward:
        from tasks.judge_limit import shared_judge_limit

        # its judge's calls share the Prefect server's limit with every other run and re-scoring on it
        run.scopes.enter_context(shared_judge_limit())
    return run


def unregister(run_id: str) -> None:
    run = _LIVE.pop(run_id, None)
    if run is not None:
        run.scopes.close()


@contextlib.contextmanager
def live(pipeline: Pipeline) -> Iterator[LiveRun]:
    """`pipeline`'s run is live (found by its run id) for the block."""
    run = register(pipeline)
    try:
        yield run
    finally:
        unregister(run.run_id)


def find(run_id: str) -> Optional[LiveRun]:
    return _LIVE.get(run_id)


def get(run_id: str) -> LiveRun:
    run = _LIVE.get(run_id)
    if run is None:
        raise RuntimeError(f"run '{run_id}' is not live in this process (its nodes run inside the train flow, which "
                           "starts the servers and the trainer)")
    return run
