"""A run's directory: where each iteration's outputs live (`RunPaths`), the lock that keeps two processes from
running one run id at once, and what the directory says about the run (its newest finished iteration)."""

from __future__ import annotations

import fcntl
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from areal_pipeline.checksums import has_checksums
from areal_pipeline.utils import atomic_write_text


class RunLockedError(RuntimeError):
    pass


@contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Refuse a second live run of the same run id (they would overwrite each other's outputs)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / ".lock"
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        owner = handle.read().strip() or "another process"
        handle.close()
        raise RunLockedError(f"run '{run_dir.name}' is already running ({owner}); refusing to start a second "
                             f"run with the same run_id in {run_dir}") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}")
    handle.flush()
    try:
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def run_is_locked(run_dir: Path) -> bool:
    """Whether a process holds `run_dir`'s run lock (the run is live there). Asked with a shared lock, held for an
    instant only where no process holds it."""
    path = run_dir / ".lock"
    try:
        handle = open(path, "r")
    except FileNotFoundError:
        return False
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle, fcntl.LOCK_UN)
        return False


@dataclass(frozen=True)
class RunPaths:
    run_dir: Path

    def iteration(self, k: int) -> Path:
        return self.run_dir / f"iter_{k}"

    def rollout(self, k: int) -> Path:
        return self.iteration(k) / "rollout"

    def traffic_mark(self, k: int) -> Path:
        """Where a recurring firing marks iteration k's rollout as recorded traffic (recurring/traffic.py): beside the
        shards, so that a damaged manifest cannot hide it; such a rollout is never played again."""
        return self.iteration(k) / "recorded_traffic.json"

    def episodes(self, k: int) -> Path:
        """Iteration k's episode journal (rollout/journal.py): beside its rollout shards, never among them."""
        return self.iteration(k) / "rollout.episodes"

    def batch(self, k: int) -> Path:
        return self.iteration(k) / "batch"

    def update(self, k: int) -> Path:
        return self.iteration(k) / "update.json"

    def evaluation(self, k: int) -> Path:
        return self.iteration(k) / "eval.json"

    def metrics(self, k: int) -> Path:
        return self.iteration(k) / "metrics.json"

    @property
    def checkpoints(self) -> Path:
        return self.run_dir / "checkpoints"

    def checkpoint(self, k: int) -> Path:
        return self.checkpoints / f"step_{k}"

    def weights(self, k: int) -> Path:
        return self.run_dir / "weights" / f"v{k}"

    @property
    def metrics_jsonl(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    @property
    def pinned(self) -> Path:
        """The checkpoint steps never pruned (a recurring line's champions: recurring/line.py)."""
        return self.checkpoints / "pinned.json"

    def pinned_checkpoints(self) -> set[int]:
        return set((read_json(self.pinned) or {}).get("steps", []))

    def saved_checkpoints(self) -> list[int]:
        """The steps whose checkpoint was saved to the end: its checksums.json is written last, so a save that
        crashed midway never counts (whether the files are still intact is checked where they are used)."""
        if not self.checkpoints.is_dir():
            return []
        return sorted(int(p.name.split("_")[1]) for p in self.checkpoints.glob("step_*") if has_checksums(p))

    def completed_iterations(self) -> list[int]:
        return sorted(int(p.parent.name.split("_")[1]) for p in self.run_dir.glob("iter_*/metrics.json"))


def read_json(path: Path) -> Optional[dict]:
    return json.loads(path.read_text()) if path.is_file() else None


def write_json(path: Path, record: dict) -> dict:
    atomic_write_text(path, json.dumps(record, indent=1, sort_keys=True) + "\n")
    return record


def newest_completed_iteration(run_dir: Path) -> int:
    done = RunPaths(run_dir).completed_iterations()
    return done[-1] if done else 0


def pin_checkpoint(run_dir: Path, iteration: int) -> None:
    """Keep run `run_dir`'s checkpoint at `iteration` whatever keep_checkpoints says."""
    paths = RunPaths(run_dir)
    pinned = paths.pinned_checkpoints()
    if iteration not in pinned:
        write_json(paths.pinned, {"steps": sorted({*pinned, iteration})})
