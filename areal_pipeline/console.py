"""What a training command shows in the terminal: a live progress line and warnings, instead of every log record.

A default run writes ~10 log records an iteration (each node's task run created and finished, the iteration's
flow run, the library's own lines): ~1000 lines for the default 100 iterations, where the figures a person
watches (reward, pass@1, speed, time left) scroll away. While `quiet_console` is active:

- every record still goes where it went (Prefect's run logs, through its API handler) and to a log file,
  `<run_dir>/logs/train.log` (appended, one header line per command);
- the terminal shows records of WARNING and above only, and one progress line: the iteration, the reward, the
  last eval pass@1, seconds an iteration and the time left; redrawn in place on a terminal (rich's live display),
  and on a pipe (CI, `| tee`) printed as a line about every tenth of the run;
- `verbose=True` leaves the terminal as it was (every record), with no progress line.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, Iterator, Optional

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
PIPE_LINES = 10  # a progress line about every 1/PIPE_LINES of the run where the output is not a terminal
PIPE_SECONDS = 30.0  # ... and at least this often
BAR_WIDTH = 28  # characters


class RunFormatter(logging.Formatter):
    """LOG_FORMAT, with the Prefect task or flow run a record comes from (Prefect's run loggers attach its name)."""

    def __init__(self):
        super().__init__(LOG_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        run = getattr(record, "task_run_name", None) or getattr(record, "flow_run_name", None)
        return text.replace(f"{record.name}: ", f"{record.name} [{run}]: ", 1) if run else text


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def failures_text(record: dict[str, Any]) -> str:
    """"fail 3 (retrieval 2, reward_timeout 1)": an iteration's episodes that failed for good (its `failures/<cause>`
    metrics, most first); "" when none did."""
    counts = sorted(((int(n), key.partition("/")[2]) for key, n in record.items()
                     if key.startswith("failures/") and n), key=lambda c: (-c[0], c[1]))
    if not counts:
        return ""
    return f"fail {sum(n for n, _ in counts)} (" + ", ".join(f"{cause} {n}" for n, cause in counts) + ")"


class ProgressLine:
    """The run's progress as one line, fed by the run's events (`started`, `iteration`, `finished`, `failed`).

    On a terminal rich's live display redraws it in place, and what goes through `write` (log records included)
    is printed above it; elsewhere (CI logs, `| tee`) it is printed as a plain line about every tenth of the run.
    """

    def __init__(self, run_id: str, stream: IO[str], live: Optional[bool] = None):
        """`live`: redraw in place; by default where rich finds an interactive terminal (not a pipe, a file or a
        dumb terminal)."""
        self.run_id = run_id
        self.console = Console(file=stream, force_terminal=live, force_interactive=live, highlight=False)
        self.live = self.console.is_interactive
        self.first = self.last = 0
        self.done = 0
        self.reward: Optional[float] = None
        self.pass_at_1: Optional[float] = None
        self.failures = ""  # the last iteration's episodes that failed for good, per cause: "fail 3 (...)"
        self._times: list[float] = []  # wall time at each finished iteration (the start first)
        self._printed_at = (0, 0.0)  # (iteration, time) of the last line printed to a pipe
        self._lock = threading.RLock()
        # Redrawn on the run's events only, and sys.stdout/sys.stderr left alone: no refresh thread and no
        # process-wide stream swap for a display that changes once an iteration. A finished bar in green: rich's
        # own colour for it turns grey on a 16-colour terminal (TERM=xterm), where the bar would look empty.
        bar = BarColumn(bar_width=BAR_WIDTH, finished_style="green")
        self._bar = Progress(TextColumn("{task.description}", markup=False), bar,
                             TextColumn("{task.fields[status]}", markup=False), console=self.console,
                             auto_refresh=False, redirect_stdout=False, redirect_stderr=False)
        self._task = self._bar.add_task(run_id, status="")

    # ----- the run's events ---------------------------------------------------------------------------
    def started(self, first: int, last: int) -> None:
        with self._lock:
            self.first, self.last, self.done = first, last, first - 1
            self._times = [time.monotonic()]
            if first > 1:
                self.write(f"run {self.run_id}: iterations 1..{first - 1} are finished; continuing at {first}")
            self.draw(force=True)
            if self.live:
                self._bar.start()
                # rich hides the cursor until the display stops; a command that ends by os._exit (a forced
                # stop, the API gone) would leave the terminal without one
                self.console.show_cursor(True)

    def iteration(self, k: int, record: dict[str, Any]) -> None:
        with self._lock:
            self.done = max(self.done, k)
            self.reward = record.get("reward_mean", self.reward)
            if record.get("eval_pass_at_1") is not None:
                self.pass_at_1 = record["eval_pass_at_1"]
            self.failures = failures_text(record)
            self._times.append(time.monotonic())
            self.draw(force=k >= self.last)

    def finished(self) -> None:
        with self._lock:
            if self.live or self._printed_at[0] != self.done:  # a pipe has had the last line already
                self.draw(force=True)
            self.stop()

    def failed(self) -> None:
        self.stop()

    # ----- rendering ----------------------------------------------------------------------------------
    def seconds_per_iteration(self) -> Optional[float]:
        """Over the last 10 iterations (the first one includes the start-up of the loop, so it is left out once
        there are others)."""
        times = self._times[-11:]
        if len(times) > 2 and len(self._times) <= 11:
            times = times[1:]
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None

    def status(self) -> str:
        """"3/30  reward 0.711  pass@1 0.500  0.71 s/it  ETA 0:19": what follows the bar."""
        parts = [f"{self.done}/{self.last}", f"reward {self.reward:.3f}" if self.reward is not None else "reward -",
                 f"pass@1 {self.pass_at_1:.3f}" if self.pass_at_1 is not None else "pass@1 -"]
        if self.failures:
            parts.append(self.failures)
        rate = self.seconds_per_iteration()
        if rate is None:
            parts.append("starting")
        else:
            parts += [f"{rate:.2f} s/it", f"ETA {_duration(rate * (self.last - self.done))}"]
        return "  ".join(parts)

    def text(self) -> str:
        """The line as printed to a pipe: "demo [##---...] 3/30  reward ..."."""
        filled = int(BAR_WIDTH * self._fraction())
        return f"{self.run_id} [{'#' * filled}{'-' * (BAR_WIDTH - filled)}] {self.status()}"

    def _fraction(self) -> float:
        return max(0, self.done - self.first + 1) / max(1, self.last - self.first + 1)

    def draw(self, force: bool = False) -> None:
        with self._lock:
            if self.live:
                self._bar.update(self._task, total=1.0, completed=self._fraction(), status=self.status(),
                                 refresh=self._bar.live.is_started)
                return
            k, at = self._printed_at
            step = max(1, (self.last - self.first + 1) // PIPE_LINES)
            if force or self.done - k >= step or time.monotonic() - at >= PIPE_SECONDS:
                self.write(self.text())
                self._printed_at = (self.done, time.monotonic())

    def stop(self) -> None:
        """End the live display, leaving its last line on the screen (nothing to do on a pipe)."""
        with self._lock:
            if self.live:
                self._bar.stop()

    def write(self, line: str) -> None:
        """A line of its own, above the live line."""
        with self._lock:
            self.console.out(line)


class _AboveProgress(logging.Handler):
    """The terminal's log handler while the progress line is shown: records are written above the line."""

    def __init__(self, progress: ProgressLine, level: int):
        super().__init__(level)
        self.progress = progress
        self.setFormatter(RunFormatter())

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.progress.write(self.format(record))
        except Exception:
            self.handleError(record)


def _terminal_handlers(root: logging.Logger) -> list[logging.Handler]:
    return [h for h in root.handlers if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler)
            and getattr(h, "stream", None) in (sys.stderr, sys.stdout)]


@contextlib.contextmanager
def quiet_console(run_id: str, run_dir: Path, verbose: bool = False, stream: Optional[IO[str]] = None,
                  live: Optional[bool] = None, log_name: str = "train.log") -> Iterator[Optional[ProgressLine]]:
    """For the block: every log record also to `<run_dir>/logs/<log_name>`; unless `verbose`, the terminal shows
    WARNING and above plus the progress line that is yielded (feed it the run's events), else None."""
    stream = stream or sys.stderr
    with run_log_file(run_dir, log_name) as log_path:
        with _quiet_terminal(run_id, log_path, verbose, stream, live) as progress:
            yield progress


@contextlib.contextmanager
def run_log_file(run_dir: Path, log_name: str = "train.log", header: str = "") -> Iterator[Path]:
    """For the block, every log record of this process also to `<run_dir>/logs/<log_name>` (appended, after a
    header line: when, and the command or `header`), unless a handler of this process writes there already (a
    flow run of a command whose `quiet_console` opened it: nothing is written twice)."""
    log_path = Path(run_dir) / "logs" / log_name
    root = logging.getLogger()
    if any(isinstance(h, logging.FileHandler) and Path(h.baseFilename) == log_path.resolve() for h in root.handlers):
        yield log_path
        return
    log_path.parent.mkdir(parents=True, exist_ok=True)
    file_handler = logging.FileHandler(log_path, encoding="utf-8")
    file_handler.setFormatter(RunFormatter())
    file_handler.setLevel(logging.INFO)
    with open(log_path, "a", encoding="utf-8") as head:
        head.write(f"==== {datetime.now(timezone.utc).isoformat()} {header or ' '.join(sys.argv)}\n")
    root.addHandler(file_handler)
    try:
        yield log_path
    finally:
        root.removeHandler(file_handler)
        file_handler.close()


@contextlib.contextmanager
def _quiet_terminal(run_id: str, log_path: Path, verbose: bool, stream: IO[str],
                    live: Optional[bool]) -> Iterator[Optional[ProgressLine]]:
    root = logging.getLogger()
    progress = None if verbose else ProgressLine(run_id, stream, live)
    muted = [] if verbose else _terminal_handlers(root)
    levels = [h.level for h in muted]
    around = None
    if progress is not None:
        for handler in muted:
            handler.setLevel(logging.CRITICAL + 1)
        around = _AboveProgress(progress, logging.WARNING)
        root.addHandler(around)
        progress.write(f"run {run_id}: full logs in {log_path} and the Prefect run logs (--verbose shows them here)")
    try:
        yield progress
    finally:
        if progress is not None:
            progress.stop()
        for handler, level in zip(muted, levels):
            handler.setLevel(level)
        if around is not None:
            root.removeHandler(around)
