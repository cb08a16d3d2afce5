"""The experiment trackers a run's metrics also go to, besides Prefect: TensorBoard, Weights & Biases and MLflow
(config `trackers`, docs/trackers.md). Each gets the run's resolved config once at start and every iteration's
metrics record (its step: the record's iteration), and gives back where its run is (a URL or a directory).

A tracker never fails a run: every call has a deadline (`trackers.timeout`), and a tracker that raises or misses
it is warned about and left out for the rest of the run. A run continued under the same run id continues the
same tracker runs (each finds its own by the run id), and no step is logged twice: the newest step each tracker
took is kept in <run_dir>/trackers.json.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from areal_pipeline.utils import atomic_write_text, get_logger

logger = get_logger("trackers")


class Tracker(Protocol):
    name: str

    def start(self, run_id: str, config: dict[str, Any], links: dict[str, str]) -> str:
        """Open (or continue) this run's tracker run; where it is (URL or directory)."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def finish(self, status: str) -> None:
        """`status`: completed | failed | cancelled."""


def enabled_trackers(cfg: Any, run_dir: Path) -> list[Tracker]:
    """The trackers `cfg.trackers` turns on (the config's rules checked that their packages are installed)."""
    trackers: list[Tracker] = []
    if cfg.trackers.tensorboard:
        from areal_pipeline.trackers.tensorboard_log import TensorBoardTracker

        trackers.append(TensorBoardTracker(run_dir / "tensorboard"))
    if cfg.trackers.wandb.active:
        from areal_pipeline.trackers.wandb_run import WandbTracker

        trackers.append(WandbTracker(cfg.trackers.wandb, run_dir))
    if cfg.trackers.mlflow.enabled:
        from areal_pipeline.trackers.mlflow_run import MlflowTracker

        trackers.append(MlflowTracker(cfg.trackers.mlflow, cfg.trackers.timeout))
    return trackers


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics record's numbers, its iteration aside (the step)."""
    return {key: float(value) for key, value in record.items()
            if key != "iteration" and isinstance(value, (int, float)) and not isinstance(value, bool)}


class Trackers:
    """The run's enabled trackers, each call to each one under a deadline."""

    def __init__(self, trackers: list[Tracker], run_dir: Path, timeout: float = 30.0):
        self.active = list(trackers)
        self.timeout = timeout
        self.state_path = Path(run_dir) / "trackers.json"
        self.lock = threading.Lock()
        self.state: dict[str, dict[str, Any]] = (json.loads(self.state_path.read_text())
                                                 if self.state_path.is_file() else {})

    @classmethod
    def of(cls, cfg: Any) -> "Trackers":
        return cls(enabled_trackers(cfg, cfg.run_dir), cfg.run_dir, cfg.trackers.timeout)

    def start(self, run_id: str, config: dict[str, Any], links: dict[str, str]) -> dict[str, str]:
        """Each tracker's run, {tracker: URL or directory}; a tracker that cannot start is left out."""
        where = {}
        for tracker in list(self.active):
            place = self._call(tracker, "start", lambda t=tracker: t.start(run_id, config, links))
            if place is not None:
                where[tracker.name] = place
                self.state.setdefault(tracker.name, {})["run"] = place
        self._save()
        return where

    def log(self, record: dict[str, Any]) -> None:
        with self.lock:
            self._log(int(record["iteration"]), scalars(record))

    def _log(self, step: int, metrics: dict[str, float]) -> None:
        for tracker in list(self.active):
            if step <= self.state.get(tracker.name, {}).get("last_step", -1):  # step 0: the initial evaluation
                continue  # a continued run's iteration this tracker has already
            if self._call(tracker, "log", lambda t=tracker: t.log(step, metrics), default=False) is not False:
                self.state.setdefault(tracker.name, {})["last_step"] = step
        self._save()

    def finish(self, status: str) -> None:
        for tracker in list(self.active):
            self._call(tracker, "finish", lambda t=tracker: t.finish(status))
        self.active = []

    def _call(self, tracker: Tracker, what: str, call: Callable[[], Any], default: Any = None) -> Any:
        """`call()`'s value, or `default` (and the tracker left out) when it raises or outlasts the deadline. It
        runs on a daemon thread, so a tracker hung on a network call never holds the run (nor its exit)."""
        outcome: dict[str, Any] = {}

        def target() -> None:
            try:
                outcome["value"] = call()
            except BaseException as e:  # noqa: BLE001  (whatever a tracker raises, the run goes on)
                outcome["error"] = e

        thread = threading.Thread(target=target, name=f"tracker-{tracker.name}-{what}", daemon=True)
        thread.start()
        thread.join(self.timeout)
        problem: Optional[str] = None
        if thread.is_alive():
            problem = f"no answer within {self.timeout:g} s (trackers.timeout)"
        elif "error" in outcome:
            problem = f"{type(outcome['error']).__name__}: {outcome['error']}"
        if problem is None:
            return outcome.get("value")
        logger.warning("tracker %s left out of this run: its %s failed (%s); the run goes on without it",
                       tracker.name, what, problem)
        self.active.remove(tracker)
        return default

    def _save(self) -> None:
        if self.state:
            atomic_write_text(self.state_path, json.dumps(self.state, indent=1, sort_keys=True) + "\n")
