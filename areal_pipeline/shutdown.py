"""Stopping a run on Ctrl-C or SIGTERM: at once, completely, and within a bounded time.

A stop signal (Ctrl-C sends SIGINT to the whole foreground process group; `timeout`, a scheduler or a supervisor
send SIGTERM to the process or its group) first stops everything the process registered here (inference servers,
trainer, tool servers; not a temporary Prefect API, where the run's end is still to be recorded): the step in
flight then fails at once instead of being waited for, and no retry starts anything again. The main thread then
unwinds (KeyboardInterrupt) so that the orchestrator can record the run as crashed. Unwinding normally takes a
second or two; if it has not ended the process `FORCED_EXIT_AFTER_S` seconds after the signal (an API that no
longer answers, a thread that does not notice), the process exits then with the signal's status, once its final
reports (`register_final_report`: what the unwinding would have recorded, such as a flow run's crash) have had
FINAL_REPORTS_DEADLINE_S. A repeated signal changes nothing: Prefect re-sends SIGTERM to its own process once it
has recorded the crash, so a repeat is not a user asking twice.

Another library may put its own handler in place of this one for a while: Prefect's engine does for SIGTERM
during a whole flow run, and its handler first reports the crash to the API, which takes minutes when the API is
gone. So the handlers also take the signal through `signal.set_wakeup_fd`, which the interpreter writes to
whatever Python handler is installed: a thread reading it starts the stop at once (`on_stop_signal`, once).
"""

from __future__ import annotations

import faulthandler
import itertools
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable, Optional

logger = logging.getLogger("areal_pipeline.shutdown")

FORCED_EXIT_AFTER_S = 8.0
FINAL_REPORTS_DEADLINE_S = 2.0

_cleanups: dict[int, tuple[str, Callable[[], None]]] = {}
_final_reports: dict[int, tuple[str, Callable[[], None]]] = {}
_ids = itertools.count()
_lock = threading.Lock()
_first_signal: Optional[int] = None
_stopped = threading.Event()  # set once the first stop signal's clean-ups have run
_handler: Optional[Callable] = None  # the stop handler `install_handlers` installed in this process, if it did


def register(what: str, stop: Callable[[], None]) -> int:
    """Run `stop` when a stop signal arrives (until `unregister`); `what` names it in messages."""
    with _lock:
        handle = next(_ids)
        _cleanups[handle] = (what, stop)
    return handle


def register_final_report(what: str, report: Callable[[], None]) -> int:
    """Run `report` before a forced exit (until `unregister`): the record that the main thread's unwinding would
    have made and a forced exit cuts short. The reports run side by side with the ones registered before, all
    within FINAL_REPORTS_DEADLINE_S; the exit does not wait for one longer."""
    with _lock:
        handle = next(_ids)
        _final_reports[handle] = (what, report)
    return handle


def unregister(handle: int) -> None:
    with _lock:
        _cleanups.pop(handle, None)
        _final_reports.pop(handle, None)


def exit_status(signum: int) -> int:
    """The shell's convention for a process ended by a signal: 128 + its number (130 for Ctrl-C)."""
    return 128 + signum


def requested_by() -> Optional[int]:
    """The signal that asked this process to stop, if one did."""
    return _first_signal


def stop_everything() -> None:
    """Run every registered clean-up once (each failure is logged; the others still run)."""
    with _lock:
        cleanups = list(_cleanups.values())
        _cleanups.clear()
    for what, stop in cleanups:
        try:
            stop()
        except Exception:
            logger.exception("could not stop %s", what)


def on_stop_signal(signum: int) -> None:
    """What a stop signal does before the main thread unwinds: stop the run's processes, and make sure the
    process ends within `FORCED_EXIT_AFTER_S` seconds whatever happens next."""
    global _first_signal
    with _lock:
        first = _first_signal is None
        if first:
            _first_signal = signum
    if not first:
        # the other caller (the watching thread, or the handler) may still be stopping: the handler unwinds the
        # main thread only once that is done, as when it stops everything itself
        _stopped.wait(FORCED_EXIT_AFTER_S)
        return
    name = signal.Signals(signum).name
    logger.warning("%s received: stopping the run's servers and trainer", name)
    # the limit counts from the signal, however long the clean-ups take
    timer = threading.Thread(target=_exit_if_still_running, args=(signum, time.monotonic()),
                             name="forced-exit", daemon=True)
    timer.start()
    try:
        stop_everything()
    finally:
        _stopped.set()


def _exit_if_still_running(signum: int, since: float) -> None:
    time.sleep(max(0.0, FORCED_EXIT_AFTER_S - (time.monotonic() - since)))
    _force_exit(signum, f"still running {FORCED_EXIT_AFTER_S:.0f} s after the stop signal")


def _force_exit(signum: int, why: str) -> None:
    stop_everything()
    sys.stderr.write(f"\n{signal.Signals(signum).name}: {why}; exiting now (servers and trainer stopped). "
                     f"What each thread was doing:\n")
    sys.stderr.flush()
    # what held the unwinding up is the one thing a forced exit cannot otherwise tell
    try:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    except (ValueError, OSError):  # a stderr without a file descriptor (io.UnsupportedOperation is both)
        pass
    sys.stderr.flush()
    _final_reports_within(FINAL_REPORTS_DEADLINE_S)
    os._exit(exit_status(signum))


def _final_reports_within(deadline_s: float) -> None:
    with _lock:
        reports = list(_final_reports.values())
        _final_reports.clear()

    def run(what: str, report: Callable[[], None]) -> None:
        try:
            report()
        except Exception as e:  # the exit goes on: the report is lost, and says so
            sys.stderr.write(f"could not report {what} before exiting: {type(e).__name__}: {e}\n")

    threads = [threading.Thread(target=run, args=entry, name="final-report", daemon=True) for entry in reports]
    for thread in threads:
        thread.start()
    until = time.monotonic() + deadline_s
    for (what, _), thread in zip(reports, threads):
        thread.join(max(0.0, until - time.monotonic()))
        if thread.is_alive():
            sys.stderr.write(f"could not report {what} before exiting: no answer within {deadline_s:.0f} s\n")
    sys.stderr.flush()


def install_handlers(signals=(signal.SIGINT, signal.SIGTERM)) -> None:
    """In the main thread of a command: each stop signal runs `on_stop_signal`, then raises KeyboardInterrupt."""
    global _handler

    def handle(signum, frame):
        on_stop_signal(signum)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for signum in signals:
        signal.signal(signum, handle)
    _handler = handle
    _watch_signals(frozenset(int(s) for s in signals))


def _watch_signals(signals: frozenset) -> None:
    """Start the stop from a thread as soon as one of `signals` arrives, whichever Python handler then runs (see
    the module's docstring). Where the process's wake-up fd is taken already (an event loop's), the handlers
    alone do it."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    if previous != -1:  # one owner only: a second call, or an event loop's
        signal.set_wakeup_fd(previous)
        os.close(read_end)
        os.close(write_end)
        return

    def watch() -> None:
        while True:
            try:
                received = os.read(read_end, 64)
            except OSError:
                return
            for signum in received:
                if signum in signals:
                    on_stop_signal(signum)

    threading.Thread(target=watch, name="stop-signal-watch", daemon=True).start()
    # A forked child (a worker of a fork context) inherits the wake-up fd, and the pipe with it: a signal to the
    # child would read here as one to this process.
    os.register_at_fork(after_in_child=_forget_wakeup_fd)


def _forget_wakeup_fd() -> None:
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:  # not the child's main thread: nothing to forget there
        pass


def handlers_installed() -> bool:
    """Whether this process's command installed the stop handlers (`install_handlers`): a command of the
    project's own, not a process that a Prefect worker or runner started to run a flow."""
    return _handler is not None
