"""How the iteration runs of one train run overlap: in their bookkeeping, never in their nodes.

A flow run costs ~150 ms of API calls to start and ~70 ms to finish (metrics, artifacts, final state) on SQLite,
as much as a fifth of a default iteration. So iteration k+1's run starts while iteration k's ppo_update runs, and
its first node waits until k's last node is done; iteration k reports while k+1 works. At most two iteration
runs are in flight. In asynchronous mode (eta > 0) iteration k+1's rollout and advantages also run during k's
update (`Pipeline.ahead_nodes`), and its own update is the node that waits.

`run_iterations` starts the runs; inside one, `turn(run_id, k, pipeline)` is iteration k's place among them: its
`node(task)` runs a node once the nodes it must follow have, and `report(...)` keeps the reports in order.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional, TypeVar

from areal_pipeline import shutdown
from areal_pipeline.pipeline import Pipeline
from areal_pipeline.utils import atomic_write_text
from flows import artifacts, control

T = TypeVar("T")

# The node during which the next iteration's run may start its bookkeeping: the longest one.
NEXT_RUN_STARTS_DURING = "ppo_update"


@dataclass
class Handoff:
    """What iteration k tells iteration k+1 of the same train run."""
    next_may_start: threading.Event = field(default_factory=threading.Event)
    nodes_done: threading.Event = field(default_factory=threading.Event)
    reported: threading.Event = field(default_factory=threading.Event)
    launched_at: float = field(default_factory=time.perf_counter)
    nodes_done_at: Optional[float] = None
    failed: bool = False

    def finish_unrun(self, failed: bool) -> None:
        """The iteration's call returned without running its body: Prefect handed back the iteration's earlier
        finished run (a retried train run calls its finished iterations again, see `planned_iterations`)."""
        self.failed = failed
        for event in (self.next_may_start, self.nodes_done, self.reported):
            event.set()


_HANDOFFS: dict[tuple[str, int], Handoff] = {}


class PreviousIterationFailed(Exception):
    """Iteration k - 1 failed: iteration k runs no node that needs its policy."""


class Turn:
    """Iteration k's place among the iteration runs of its train run (see the module's docstring)."""

    def __init__(self, run_id: str, k: int, pipeline: Pipeline):
        self.run_id, self.k = run_id, k
        self.handoff, self.previous = _HANDOFFS.get((run_id, k)), _HANDOFFS.get((run_id, k - 1))
        self.due = pipeline.due_nodes(k)
        # the first node that needs iteration k - 1 to be done: the rollout, or in asynchronous mode the update
        self.waits_before = next(name for name in self.due if name not in pipeline.ahead_nodes)
        self.results: dict[str, Any] = {}

    def node(self, task, after=None):
        """Run the node `task(run_id, k)` (a Prefect task whose name is the node's), after the node whose state
        is `after` (the edge the UI draws); its state, once it completed (its error is raised)."""
        name = task.name
        if name == self.waits_before and self.previous is not None:
            self.previous.nodes_done.wait()
            if self.previous.failed:
                raise PreviousIterationFailed(f"iteration {self.k - 1} failed, so iteration {self.k} did not finish")
        if name == NEXT_RUN_STARTS_DURING and self.handoff is not None:
            self.handoff.next_may_start.set()
        state = task(self.run_id, self.k, wait_for=[after] if after is not None else None, return_state=True)
        self.results[name] = state.result()
        return state

    def report(self, publish: Callable[[], T]) -> T:
        """`publish()` once iteration k - 1 has published its own (metrics.jsonl and artifacts stay in order)."""
        try:
            if self.previous is not None:
                self.previous.reported.wait()
            return publish()
        finally:
            if self.handoff is not None:
                self.handoff.reported.set()


@contextlib.contextmanager
def turn(run_id: str, k: int, pipeline: Pipeline) -> Iterator[Turn]:
    """Iteration k's turn for its nodes; when the block ends (done or failed), iteration k + 1 may go on."""
    current = Turn(run_id, k, pipeline)
    try:
        yield current
    finally:
        if current.handoff is not None:
            current.handoff.failed = len(current.results) < len(current.due)
            current.handoff.nodes_done_at = time.perf_counter()
            current.handoff.next_may_start.set()
            current.handoff.nodes_done.set()




def record_orchestration(pipeline: Pipeline, k: int, period: float) -> None:
    """What the iteration cost beyond its nodes' own work: Prefect's share (`iter_<k>/orchestration.json`).
    `period` is the time from the previous iteration's last node to this one's."""
    work = sum(pipeline.step_seconds.get(k, {}).values())
    atomic_write_text(pipeline.paths.iteration(k) / "orchestration.json", json.dumps(
        {"wall_seconds": period, "node_seconds": work, "overhead_seconds": period - work}) + "\n")


@contextlib.contextmanager
def stop_everything_on_sigterm() -> Iterator[None]:
    """During a flow run Prefect's own SIGTERM handler replaces the command's (it raises TerminationSignal, so
    that the run is recorded as crashed). Ahead of it, stop the run's processes in the handler itself: that
    exception alone can be lost (raised while the main thread runs a finalizer, Python prints "Exception
    ignored" and a run went on to its end with exit code 0), and with the services stopped the node in flight
    and every later one fail at once and are not retried, whatever the exception does."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread receives signals
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def stop(signum, frame):
        shutdown.on_stop_signal(signum)
        if callable(previous):
            previous(signum, frame)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_iterations(iteration, pipeline: Pipeline, first: int, last: int, progress) -> None:
    """Iterations first..last as runs of the flow `iteration(run_id, k)`, each started while the one before it
    updates."""
    run_id, total = pipeline.cfg.run_id, pipeline.cfg.total_iterations
    in_flight: list[tuple[int, Future]] = []
    failure: Optional[BaseException] = None

    def finish_oldest() -> None:
        nonlocal failure
        k, future = in_flight.pop(0)
        handoff = _HANDOFFS[(run_id, k)]
        try:
            future.result()
        except BaseException as error:  # the later run in flight sees the failure and does not run its nodes
            failure = failure or error
            if not handoff.nodes_done.is_set():
                handoff.finish_unrun(failed=True)
        else:
            if not handoff.nodes_done.is_set():
                handoff.finish_unrun(failed=False)
                artifacts.update_progress(progress, total, k)
                return
            before = _HANDOFFS.get((run_id, k - 1))
            # the period since the previous iteration's nodes ended, or since this one's launch when that one did
            # not run here
            started = before.nodes_done_at if before is not None and before.nodes_done_at else handoff.launched_at
            record_orchestration(pipeline, k, handoff.nodes_done_at - started)
            artifacts.update_progress(progress, total, k)

    with ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"{run_id}-iteration") as pool:
        try:
            for k in range(first, last + 1):
                control.hold_while_paused(run_id)  # paused in Prefect: start nothing new until resumed
                handoff = _HANDOFFS[(run_id, k)] = Handoff()
                # the child run needs the parent's flow run context (and the heartbeat setting) in its thread
                future = pool.submit(contextvars.copy_context().run, iteration, run_id, k)
                in_flight.append((k, future))
                while not handoff.next_may_start.wait(0.1) and not future.done():
                    pass
                # a failed iteration is waited for here: no later run is started only to be cancelled
                while len(in_flight) > 1 or (in_flight and (in_flight[-1][1].done() or handoff.failed)):
                    finish_oldest()
                if failure is not None:
                    break
        except BaseException:
            # Ctrl-C or SIGTERM reached this thread: stop the services first, so that the node in flight fails
            # at once (and is not retried) instead of being waited for
            pipeline.services.stop()
            raise
        finally:
            while in_flight:
                finish_oldest()
            for key in [key for key in _HANDOFFS if key[0] == run_id]:
                del _HANDOFFS[key]
    if failure is not None:
        raise failure
