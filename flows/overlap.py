"""How the iterations of one train run overlap: in their bookkeeping, never in their nodes.

Starting and finishing a flow run are synchronous API calls (create, states, metrics, artifacts) that would
otherwise sit between two iterations' nodes (bench/RESULTS.md has what they cost). So the flow run of
iteration k+1 starts while iteration k's ppo_update runs, and its first node waits until k's last node is done;
iteration k reports while k+1 works. At most two iterations are in flight. In asynchronous mode (eta > 0)
iteration k+1's first steps (rollout, reference logprobs, advantages: `Pipeline.ahead_nodes`) also run during
k's update, and its first step after them is the node that waits. Where one flow run holds several iterations
(`iterations_per_flow_run`), its iterations overlap inside it the same way, and the next flow run starts during
its last iteration's update.

`run_iterations` starts the flow runs (`run_group` the iterations inside one); `turn(run, k)` is iteration k's
place among them: its `node(name, call)` runs a node once the nodes it must follow have, and `report(...)` keeps
the reports in order. What they share lives on the run's record (`tasks.runs.LiveRun`).
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
from areal_pipeline.steps import LONGEST, STEPS
from areal_pipeline.utils import atomic_write_text
from flows import artifacts
from tasks.runs import LiveRun

T = TypeVar("T")


@dataclass
class Handoff:
    """What iteration k tells iteration k+1 of the same train run."""
    next_may_start: threading.Event = field(default_factory=threading.Event)
    nodes_done: threading.Event = field(default_factory=threading.Event)
    reported: threading.Event = field(default_factory=threading.Event)
    launched_at: float = field(default_factory=time.perf_counter)
    nodes_done_at: Optional[float] = None
    failed: bool = False
    accounted: bool = False  # its orchestration record and progress are written

    def finish_unrun(self, failed: bool) -> None:
        """The iteration's call returned without running its body: Prefect handed back the iteration's earlier
        finished run (a retried train run calls its finished iterations again, see `planned_iterations`)."""
        self.failed = failed
        for event in (self.next_may_start, self.nodes_done, self.reported):
            event.set()


class PreviousIterationFailed(Exception):
    """Iteration k - 1 failed: iteration k runs no node that needs its policy."""


# The longest iteration k - 1 can take once k waits on it: each of its nodes, every retry, at its own limit.
ITERATION_LIMIT_S = sum(step.limit_s * (1 + step.retries) + sum(
    step.retry_delay_seconds if isinstance(step.retry_delay_seconds, list) else [step.retry_delay_seconds]
    * step.retries) for step in STEPS)
_WAIT_POLL_S = 0.5


def _wait_for(event: threading.Event, run: LiveRun, what: str) -> None:
    """Wait for `event`, set by the iteration before, at most ITERATION_LIMIT_S, and no longer once a stop signal
    arrived or the Prefect API is gone (flows/control.py): the waiting thread then fails too."""
    from flows.control import APIUnavailable

    limit = time.monotonic() + ITERATION_LIMIT_S
    while not event.wait(_WAIT_POLL_S):
        if shutdown.requested_by() is not None:
            raise PreviousIterationFailed(f"{what}: stopped by {signal.Signals(shutdown.requested_by()).name}")
        if run.control is not None and run.control.api_gone is not None:
            raise APIUnavailable(f"{what}: {run.control.api_gone}")
        if time.monotonic() > limit:
            raise TimeoutError(f"{what}: not done within {ITERATION_LIMIT_S} s, the longest its nodes may take")


class Turn:
    """Iteration k's place among the iteration runs of its train run (see the module's docstring)."""

    def __init__(self, run: LiveRun, k: int):
        self.run, self.k = run, k
        self.handoff, self.previous = run.handoffs.get(k), run.handoffs.get(k - 1)
        self.ahead = run.pipeline.ahead_nodes
        self.waited = self.previous is None

    def node(self, name: str, call: Callable[[], T]) -> T:
        """`call()`, which runs node `name`, once the nodes it must follow have run: the first node that needs
        iteration k - 1 to be done (the rollout, or in asynchronous mode the first after the `ahead` ones) waits
        for it. Returns what `call` does."""
        if not self.waited and name not in self.ahead:
            self.waited = True
            _wait_for(self.previous.nodes_done, self.run, f"iteration {self.k} waiting for iteration {self.k - 1}")
            if self.previous.failed:
                raise PreviousIterationFailed(f"iteration {self.k - 1} failed, so iteration {self.k} did not finish")
        if name == LONGEST and self.handoff is not None:
            self.handoff.next_may_start.set()
        if self.run.control is None:
            return call()
        with self.run.control.node(f"{name} of iteration {self.k}"):  # none starts once the API is gone
            return call()

    def report(self, publish: Callable[[], T]) -> T:
        """`publish()` once iteration k - 1 has published its own (metrics.jsonl and artifacts stay in order)."""
        try:
            if self.previous is not None:
                _wait_for(self.previous.reported, self.run, f"iteration {self.k}'s report waiting for "
                                                            f"iteration {self.k - 1}'s")
            return publish()
        finally:
            if self.handoff is not None:
                self.handoff.reported.set()


@contextlib.contextmanager
def turn(run: LiveRun, k: int) -> Iterator[Turn]:
    """Iteration k's turn for its nodes; when the block ends (done or failed), iteration k + 1 may go on."""
    current = Turn(run, k)
    failed = True
    try:
        yield current
        failed = False
    finally:
        if current.handoff is not None:
            current.handoff.failed = failed
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
    """Stop the run's processes at once when SIGTERM arrives during the block (a flow run's body).

    During a flow run Prefect's SIGTERM handler is installed: it raises TerminationSignal in the main thread, and
    the engine records the run as crashed, or as cancelled where a Prefect worker or runner sent the signal after
    asking the run to cancel (the run acknowledges that request only while Prefect's own handler is installed).

    In a command of the project's own (`areal-pipeline train`, a sweep's run: `shutdown.handlers_installed()`) no
    worker is waiting for such an acknowledgement, so the project's handler goes ahead of Prefect's, which it then
    calls: it stops the services in the handler itself. The exception alone can be lost (raised while the main
    thread runs a finalizer, Python prints "Exception ignored" and a run went on to its end with exit code 0);
    with the services stopped, the node in flight and every later one fail at once and are not retried.

    In a process that a worker or runner started, Prefect's handler stays: its TerminationSignal, once it reaches
    this block, runs the project's reaction to the signal (`shutdown.on_stop_signal`: what is still registered is
    stopped, and the process ends within seconds), and the flows' `STOP_HOOKS` stop what is left."""
    from prefect.exceptions import TerminationSignal

    chained = shutdown.handlers_installed() and threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if chained else None

    def stop(signum, frame):
        shutdown.on_stop_signal(signum)
        if callable(previous):
            previous(signum, frame)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    if chained:
        signal.signal(signal.SIGTERM, stop)
    try:
        yield
    except TerminationSignal as stopped:
        shutdown.on_stop_signal(stopped.signal)
        raise
    finally:
        if chained:
            signal.signal(signal.SIGTERM, previous)


def stop_what_the_process_started(flow, flow_run, state) -> None:
    """A flow's on_crashed / on_cancellation hook (Prefect's public hooks): what this process registered to stop
    on a stop signal (the services of its runs, a sweep's runs) is stopped, whichever way the run ended."""
    shutdown.stop_everything()


STOP_HOOKS = {"on_crashed": [stop_what_the_process_started], "on_cancellation": [stop_what_the_process_started]}


def run_iterations(call: Callable[[int, int], Any], run: LiveRun, first: int, last: int, per_run: int,
                   progress: artifacts.Progress) -> None:
    """Iterations first..last in units of `per_run` consecutive iterations, `call(k, until)` running iterations
    k..until (a flow run of the `iteration` flow), each unit started while the last iteration of the unit before
    it updates."""
    units = [(k, min(k + per_run - 1, last)) for k in range(first, last + 1, per_run)]
    run.progress = progress
    try:
        _run_units(call, run, units)
    finally:
        progress.update(None)
        run.progress = None
        run.handoffs.clear()


def run_group(body: Callable[[int], Any], run: LiveRun, first: int, last: int) -> None:
    """Inside one flow run: iterations first..last, `body(k)` each, overlapping as separate runs do."""
    _run_units(lambda k, _: body(k), run, [(k, k) for k in range(first, last + 1)])


def _run_units(call: Callable[[int, int], Any], run: LiveRun, units: list[tuple[int, int]]) -> None:
    """`call(k, until)` for each unit of iterations, in a pool of two threads: unit u + 1 starts once the last
    iteration of unit u reaches its update (or u ended), and no unit starts after one failed."""
    run_id, pipeline = run.run_id, run.pipeline
    in_flight: list[tuple[tuple[int, int], Future]] = []
    failure: Optional[BaseException] = None

    def finish_oldest() -> None:
        nonlocal failure
        (k, until), future = in_flight.pop(0)
        try:
            future.result()
        except BaseException as error:  # the later unit in flight sees the failure and does not run its nodes
            failure = failure or error
        for i in range(k, until + 1):
            _account(run, i, failed=failure is not None)

    with ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"{run_id}-iteration") as pool:
        try:
            for k, until in units:
                if run.control is not None:  # paused in Prefect: start nothing new until resumed
                    run.control.hold_while_paused(k)
                for i in range(k, until + 1):
                    run.handoffs.setdefault(i, Handoff())
                last_of_unit = run.handoffs[until]
                # a flow run started here needs the parent's flow run context (and the heartbeat setting)
                future = pool.submit(contextvars.copy_context().run, call, k, until)
                in_flight.append(((k, until), future))
                while not last_of_unit.next_may_start.wait(0.1) and not future.done():
                    pass
                # a failed unit is waited for here: no later one is started only to be cancelled
                while len(in_flight) > 1 or (in_flight and (in_flight[-1][1].done() or last_of_unit.failed)):
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
    if failure is not None:
        raise failure


def _account(run: LiveRun, k: int, failed: bool) -> None:
    """Once iteration k's unit ended: its orchestration record and the progress, once (a group's iterations are
    accounted inside its flow run, and again, as a no-op, by the unit of the train run)."""
    handoff, progress = run.handoffs[k], run.progress
    if handoff.accounted:
        return
    handoff.accounted = True
    if not handoff.nodes_done.is_set():
        # its body never ran: Prefect handed back the unit's earlier finished run (a retried train run), or
        # an earlier iteration failed
        handoff.finish_unrun(failed=failed)
        if not failed:
            progress.update(k)
        return
    if handoff.failed:
        return
    before = run.handoffs.get(k - 1)
    # the period since the previous iteration's nodes ended, or since this one's launch when that one did not
    # run here
    started = before.nodes_done_at if before is not None and before.nodes_done_at else handoff.launched_at
    record_orchestration(run.pipeline, k, handoff.nodes_done_at - started)
    progress.update(k)
