"""What Prefect asks of a running train flow run from outside: cancel it or pause it (an automation of
`areal-pipeline guard`, the UI's Cancel / Pause buttons, `prefect flow-run cancel`), and the run's events.

A worker or `serve` stops a cancelled deployment run by signalling its process; a run started with
`areal-pipeline train` has nobody to do that, and Prefect's engine only records the state. So the train run
watches its own flow run's state (one small API read every POLL_S seconds, in a background thread):

- Cancelling (or Cancelled): the run's servers and trainer are stopped at once, as a stop signal does, so the
  node in flight fails without retries; the train flow run then ends Cancelled, with the reason Prefect gave,
  and the same run id continues later from the last finished node.
- Paused: no further iteration starts (the one or two in flight finish: the next one's run starts during an
  update) until the flow run is resumed (the UI's Resume) and the run goes on where it was, servers and trainer
  kept; or until it is cancelled, or fails (a pause that timed out), which stops it as above.
- The API gone: a read that fails is counted, and a read that answers, however slowly (up to READ_TIMEOUT_S),
  ends the count (a slow API is not a dead one). Failures for longer than the grace (`AREAL_API_GRACE_S`, `--api-grace`, default 120 s)
  stop the run at its next node: the nodes in flight finish (their outputs are on disk), none starts
  (`APIUnavailable`), and a command of the project's own ends with exit code 75 (EX_TEMPFAIL), saying which
  iterations are finished and to rerun the same command once the API is back (which continues from there). It
  does not wait to report the end to an API that is gone: Prefect's retries would take minutes, and the run's
  state there stays Running until the rerun. An API back within the grace changes nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
import threading
import time
from typing import Any, Iterator, Optional

from areal_pipeline import shutdown
from areal_pipeline.metrics import read_metrics, summarize
from areal_pipeline.pipeline import Pipeline
from areal_pipeline.utils import get_logger
from flows.events import RunEvents
from tasks.runs import LiveRun

logger = get_logger(__name__)

POLL_S = 2.0
READ_TIMEOUT_S = 20.0  # a slower answer counts as a failed read
API_GRACE_ENV = "AREAL_API_GRACE_S"
DEFAULT_API_GRACE_S = 120.0
EX_TEMPFAIL = 75  # sysexits.h: a temporary failure, the same command may succeed later


class APIUnavailable(RuntimeError):
    """The Prefect API did not answer for longer than the grace: the run stops at its next node."""


def api_grace() -> float:
    """Seconds the API may fail every read before the run stops (`AREAL_API_GRACE_S`; a clear error if bad)."""
    value = os.environ.get(API_GRACE_ENV, "").strip()
    if not value:
        return DEFAULT_API_GRACE_S
    try:
        grace = float(value)
    except ValueError:
        grace = -1.0
    if not grace > 0:
        raise ValueError(f"{API_GRACE_ENV}={value!r}: the API grace must be a positive number of seconds")
    return grace


class RunControl:
    def __init__(self, pipeline: Pipeline, flow_run_id: Optional[str], poll_s: float = POLL_S,
                 grace_s: Optional[float] = None):
        self.pipeline = pipeline
        self.flow_run_id = flow_run_id
        self.poll_s = poll_s
        self.grace_s = api_grace() if grace_s is None else grace_s
        self.cancelled: Optional[str] = None  # Prefect's reason, once the flow run was cancelled
        self.api_gone: Optional[str] = None  # why, once the API failed every read for longer than the grace
        self.api_failing_since: Optional[float] = None  # monotonic time of the first failed read in a row
        self._nodes_in_flight = 0
        self._paused = threading.Event()
        self._changed = threading.Condition()
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def paused(self) -> bool:
        return self._paused.is_set()

    def start(self) -> None:
        if self.flow_run_id is None:
            return
        # the thread needs this context's Prefect settings (the API this run reports to)
        context = contextvars.copy_context()
        self._thread = threading.Thread(target=context.run, args=(self._watch,), daemon=True,
                                        name=f"{self.pipeline.cfg.run_id}-prefect-state")
        self._thread.start()

    def stop(self) -> None:
        # Not joined: the thread only reads, and a read in flight against a slow API must not delay the end of a
        # run (a stop signal gives the process seconds to exit); it ends at its next wait.
        self._done.set()
        with self._changed:
            self._changed.notify_all()

    def _watch(self) -> None:
        from prefect.client.orchestration import get_client

        from prefect.settings import (PREFECT_API_REQUEST_TIMEOUT, PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES,
                                      temporary_settings)

        url = PREFECT_API_URL.value()
        # One try per read, bounded: each poll is the retry, and the grace counts failed reads (Prefect's own
        # retries would make one read of a dead API take a minute).
        with temporary_settings(updates={PREFECT_CLIENT_MAX_RETRIES: 0,
                                         PREFECT_API_REQUEST_TIMEOUT: READ_TIMEOUT_S}), \
                get_client(sync_client=True) as client:
            while not self._done.wait(self.poll_s):
                try:
                    state = client.read_flow_run(self.flow_run_id).state
                except Exception as error:  # the API being away for a moment is no reason to stop training
                    logger.debug("could not read the state of flow run %s: %s", self.flow_run_id, error)
                    if self._on_failed_read(url, error):
                        return
                    continue
                if self.api_failing_since is not None:
                    logger.warning("run %s: the Prefect API at %s answers again", self.pipeline.cfg.run_id, url)
                self.api_failing_since = None
                if self._done.is_set() or (state is not None and self._on_state(state)):
                    return

    def _on_failed_read(self, url: str, error: Exception) -> bool:
        """Count a failed read; True once the API has failed for longer than the grace (the run then stops)."""
        now = time.monotonic()
        if self.api_failing_since is None:
            self.api_failing_since = now
            logger.warning("run %s: the Prefect API at %s does not answer (%s); the run stops at its next node if "
                           "it does not answer within %g s", self.pipeline.cfg.run_id, url, error, self.grace_s)
        if now - self.api_failing_since < self.grace_s or self._done.is_set():
            return False
        with self._changed:
            self.api_gone = (f"the Prefect API at {url} has not answered for {now - self.api_failing_since:.0f} s "
                             f"(the grace is {self.grace_s:g} s; last error: {type(error).__name__}: {error})")
            self._changed.notify_all()
        logger.error("run %s: %s: no further node starts", self.pipeline.cfg.run_id, self.api_gone)
        if shutdown.handlers_installed():
            threading.Thread(target=self._exit_when_nodes_end, daemon=True, name="api-gone-exit").start()
        return True

    @contextlib.contextmanager
    def node(self, name: str) -> Iterator[None]:
        """Node `name` runs in the block, unless the API is gone: then it does not start (APIUnavailable)."""
        with self._changed:
            if self.api_gone is not None:
                raise APIUnavailable(f"{name} not started: {self.api_gone}")
            self._nodes_in_flight += 1
        try:
            yield
        finally:
            with self._changed:
                self._nodes_in_flight -= 1
                self._changed.notify_all()

    def _exit_when_nodes_end(self) -> None:
        """In a command of the project's own: once the nodes in flight have ended (each within its own node
        deadline), stop what the process started and exit 75 at once, without the final reports to the API,
        whose retries would hold the process for minutes (a process a worker or runner started raises
        APIUnavailable at its next node instead, and Prefect's process reports what it can)."""
        with self._changed:
            while self._nodes_in_flight > 0:
                self._changed.wait(0.5)
        exit_for_api(self.pipeline, self.api_gone)

    def _on_state(self, state) -> bool:
        """React to the flow run's state; True once the run is to stop (nothing more to watch)."""
        run_id = self.pipeline.cfg.run_id
        if state.is_cancelling() or state.is_cancelled() or (self.paused and state.is_final()):
            self.cancelled = state.message or f"the flow run went {state.name}"
            logger.warning("run %s: %s in Prefect (%s): stopping its servers and trainer", run_id, state.name,
                           self.cancelled)
            self.pipeline.services.stop()
            self._set_paused(False)
            return True
        if state.is_paused() and not self.paused:
            logger.warning("run %s: paused in Prefect (%s): no further iteration starts until it is resumed",
                           run_id, state.message or state.name)
            self._set_paused(True)
        elif self.paused and state.is_running():
            logger.warning("run %s: resumed in Prefect", run_id)
            self._set_paused(False)
        return False

    def _set_paused(self, paused: bool) -> None:
        with self._changed:
            self._paused.set() if paused else self._paused.clear()
            self._changed.notify_all()

    def hold_while_paused(self, k: int) -> None:
        """Block iteration `k` while the flow run is paused (in short waits, so that a stop signal still reaches
        the main thread)."""
        with self._changed:
            if self.paused and not self._done.is_set():
                logger.warning("run %s: iteration %d waits for the flow run to be resumed", self.pipeline.cfg.run_id, k)
            while self.paused and not self._done.is_set():
                self._changed.wait(0.5)


def api_gone_message(pipeline: Pipeline, why: str) -> str:
    finished = pipeline.paths.completed_iterations()
    done = f"iterations 1..{finished[-1]} are finished on disk" if finished else "no iteration is finished yet"
    return f"run {pipeline.cfg.run_id} stopped: {why}; {done}; rerun the same command when the API is back"


def exit_for_api(pipeline: Pipeline, why: str) -> None:
    """End the process with EX_TEMPFAIL: everything it started is stopped first, the message goes to stderr."""
    message = api_gone_message(pipeline, why)
    logger.error("%s", message)
    shutdown.stop_everything()
    pipeline.services.stop()
    sys.stderr.write(f"\n{message}\n")
    sys.stderr.flush()
    logging.shutdown()  # the run's log file gets the last lines
    os._exit(EX_TEMPFAIL)


@contextlib.contextmanager
def stop_if_the_api_is_gone(control: RunControl) -> Iterator[None]:
    """Around the iterations: one that failed while the API was failing (an iteration's flow run that could not
    be created, a node that stopped at APIUnavailable) ends a command of the project's own with exit code 75,
    as `RunControl` does once the grace has passed; in a process a worker or runner started it is
    APIUnavailable."""
    try:
        yield
    except Exception as error:
        why = control.api_gone
        if why is None and control.api_failing_since is not None:
            why = (f"the Prefect API has not answered for {time.monotonic() - control.api_failing_since:.0f} s "
                   f"({type(error).__name__}: {error})")
        if why is None:
            raise
        if shutdown.handlers_installed():
            exit_for_api(control.pipeline, why)
        if isinstance(error, APIUnavailable):
            raise
        raise APIUnavailable(api_gone_message(control.pipeline, why)) from error


def _current_flow_run_id() -> Optional[str]:
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    return str(context.flow_run.id) if context is not None and context.flow_run is not None else None


@contextlib.contextmanager
def watch(run: LiveRun, first: int, last: int, config: dict[str, Any]) -> Iterator[RunControl]:
    """The train flow's iterations, watched: run events (started, then finished or failed) and Prefect's cancel
    and pause (`run.events`, `run.control` for the block). An error that a cancellation caused is swallowed here:
    the flow then returns `cancelled_state(control)`."""
    pipeline, run_id = run.pipeline, run.run_id
    flow_run_id = _current_flow_run_id()
    run_events = run.events = RunEvents(run_id, flow_run_id, read_metrics(pipeline.paths.metrics_jsonl))
    control = run.control = RunControl(pipeline, flow_run_id)
    run_events.started(first, last, config)
    control.start()
    try:
        yield control
    except BaseException as error:
        run_events.failed(error, cancelled=control.cancelled is not None)
        if control.cancelled is None or not isinstance(error, Exception):
            raise
        logger.warning("run %s was cancelled in Prefect (%s); its iterations stopped at: %s", run_id,
                       control.cancelled, error)
    else:
        run_events.finished(summarize(read_metrics(pipeline.paths.metrics_jsonl)))
    finally:
        control.stop()
        run.control = run.events = None


def cancelled_state(control: RunControl):
    """The train flow run's final state after a cancellation: Cancelled, saying why and how to go on."""
    from prefect.states import Cancelled

    cfg = control.pipeline.cfg
    finished = control.pipeline.paths.completed_iterations()
    done = f"iterations up to {finished[-1]} are finished" if finished else "no iteration finished"
    return Cancelled(message=f"run {cfg.run_id} was cancelled in Prefect ({control.cancelled}); {done}; the same "
                             f"run id continues from the last finished node")
