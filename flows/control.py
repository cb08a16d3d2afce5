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
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from typing import Any, Iterator, Optional

from areal_pipeline.metrics import read_metrics, summarize
from areal_pipeline.pipeline import Pipeline
from areal_pipeline.utils import get_logger
from flows.events import RunEvents
from tasks.runs import LiveRun

logger = get_logger(__name__)

POLL_S = 2.0


class RunControl:
    def __init__(self, pipeline: Pipeline, flow_run_id: Optional[str], poll_s: float = POLL_S):
        self.pipeline = pipeline
        self.flow_run_id = flow_run_id
        self.poll_s = poll_s
        self.cancelled: Optional[str] = None  # Prefect's reason, once the flow run was cancelled
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

        with get_client(sync_client=True) as client:
            while not self._done.wait(self.poll_s):
                try:
                    state = client.read_flow_run(self.flow_run_id).state
                except Exception as error:  # the API being away for a moment is no reason to stop training
                    logger.debug("could not read the state of flow run %s: %s", self.flow_run_id, error)
                    continue
                if self._done.is_set() or (state is not None and self._on_state(state)):
                    return

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

    def hold_while_paused(self) -> None:
        """Block while the flow run is paused (in short waits, so that a stop signal still reaches the main
        thread)."""
        with self._changed:
            while self.paused and not self._done.is_set():
                self._changed.wait(0.5)


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
