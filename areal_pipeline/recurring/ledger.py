"""A line's ledger: its champion, every firing, and the watermark of the data files its firings used.

One JSON file, `<output_dir>/lines/<line>/ledger.json`, replaced as a whole by renaming a new file over it (never
half-written), carrying the SHA-256 of its own content (a ledger edited by hand or damaged on disk is refused,
naming the file; the previous version stays beside it as `ledger.prev.json`). Only the holder of the line's lock
writes it (`line_lock`); anyone may read it.

    {"format": 1, "line": ..., "base_model": ...,
     "champion": null (the base model) | {"firing", "run_id", "iteration", "checkpoint", "model", "gate", "since"},
     "champions": [every champion in turn, rollbacks included],
     "firings": [{"id", "state": running | failed | ended, "decision", "flow_runs", "run_id", "rows", ...}],
     "watermark": {"<file>": {"sha256", "rows", "firing"}},
     "served": null | {"model", "version", "addresses", "at"},
     "traffic_taken": [the firings whose recorded traffic samples are taken (recurring/traffic.py)],
     "checksum": "<sha256 of the rest>"}

A champion's checkpoint is the line's own hard-linked copy (`champions/<firing>/`), made and verified before the
ledger names it: pruning or deleting the candidate's run leaves it intact.
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import hashlib
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from areal_pipeline.run_dir import run_is_locked
from areal_pipeline.utils import atomic_write_text

LEDGER_FORMAT = 1
OPEN_STATES = ("running", "failed")  # a firing in one of these is resumed by the line's next firing
DECISIONS = ("promoted", "rejected", "no_data", "failed", "rollback")


class LedgerError(RuntimeError):
    pass


class LineBusyError(RuntimeError):
    pass


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _checksum(data: dict[str, Any]) -> str:
    body = {k: v for k, v in data.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class Ledger:
    def __init__(self, path: Path, data: dict[str, Any]):
        self.path = Path(path)
        self.data = data

    # ----- reading and writing ---------------------------------------------------------------------
    @classmethod
    def new(cls, path: Path, line: str, base_model: str) -> "Ledger":
        return cls(path, {"format": LEDGER_FORMAT, "line": line, "created_at": now(), "base_model": base_model,
                          "champion": None, "champions": [], "firings": [], "watermark": {}, "served": None})

    @classmethod
    def load(cls, path: Path) -> Optional["Ledger"]:
        """The ledger at `path` (None where there is none yet); LedgerError where it is unreadable or its checksum
        does not match its content."""
        path = Path(path)
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise LedgerError(f"{path}: not a readable ledger ({error}); its previous version is "
                              f"{path.with_name('ledger.prev.json')}") from None
        if not isinstance(data, dict) or data.get("checksum") != _checksum(data):
            raise LedgerError(f"{path}: its content does not match its checksum (edited by hand, or damaged on "
                              f"disk); its previous version is {path.with_name('ledger.prev.json')}")
        if data.get("format") != LEDGER_FORMAT:
            raise LedgerError(f"{path}: ledger format {data.get('format')!r}, this version reads {LEDGER_FORMAT}")
        return cls(path, data)

    def save(self) -> None:
        """Write the ledger atomically (and durably: fsynced before the rename), keeping the version it replaces
        as ledger.prev.json."""
        self.data["checksum"] = _checksum(self.data)
        previous = self.path.with_name("ledger.prev.json")
        if self.path.is_file():
            staged = self.path.with_name(".ledger.prev.tmp")
            with contextlib.suppress(FileNotFoundError):
                staged.unlink()
            os.link(self.path, staged)
            os.replace(staged, previous)
        atomic_write_text(self.path, json.dumps(self.data, indent=1, sort_keys=True) + "\n")

    def snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(self.data)

    # ----- what it says ----------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.data["line"]

    @property
    def champion(self) -> Optional[dict[str, Any]]:
        return self.data["champion"]

    @property
    def firings(self) -> list[dict[str, Any]]:
        return self.data["firings"]

    @property
    def watermark(self) -> dict[str, dict[str, Any]]:
        return self.data["watermark"]

    def firing(self, firing_id: int) -> dict[str, Any]:
        for record in self.firings:
            if record["id"] == firing_id:
                return record
        raise LedgerError(f"line {self.name} has no firing {firing_id}")

    @property
    def open_firing(self) -> Optional[dict[str, Any]]:
        """The firing that started and has not ended (running when its process was killed, or failed): at most one."""
        return next((f for f in reversed(self.firings) if f["state"] in OPEN_STATES), None)

    @property
    def next_id(self) -> int:
        return 1 + max((f["id"] for f in self.firings), default=0)

    # ----- what changes it (the lock holder saves after each) ---------------------------------------------------
    def start_firing(self, kind: str, flow_run_id: Optional[str], overrides: Optional[list[str]] = None
                     ) -> dict[str, Any]:
        champion = self.champion
        record = {"id": self.next_id, "kind": kind, "overrides": list(overrides or []), "state": "running",
                  "decision": None, "started_at": now(),
                  "ended_at": None, "flow_runs": [flow_run_id] if flow_run_id else [], "run_id": None,
                  "from": {"run_id": champion["run_id"], "iteration": champion["iteration"]} if champion else None,
                  "rows": 0, "replay_rows": 0, "files": [], "gate": None, "approved_by": None, "reason": None,
                  "error": None}
        self.firings.append(record)
        return record

    def resume_firing(self, record: dict[str, Any], flow_run_id: Optional[str]) -> None:
        record["state"], record["error"] = "running", None
        if flow_run_id and flow_run_id not in record["flow_runs"]:
            record["flow_runs"].append(flow_run_id)

    def fail_firing(self, record: dict[str, Any], error: str) -> None:
        record["state"], record["error"], record["decision"] = "failed", error, "failed"

    def end_firing(self, record: dict[str, Any], decision: str, **fields: Any) -> None:
        if decision not in DECISIONS:
            raise ValueError(f"unknown decision {decision!r}")
        record.update(fields, state="ended", decision=decision, ended_at=now(), error=None)

    def consume(self, record: dict[str, Any], files: list[dict[str, Any]]) -> None:
        """The firing's files join the watermark: no later firing trains on their rows (but as replay)."""
        for f in files:
            self.watermark[f["name"]] = {"sha256": f["sha256"], "rows": f["rows"], "firing": record["id"]}
        # and the recorded traffic it took (its traffic.json, recurring/traffic.py)
        if record.get("traffic") is not None and record["id"] not in self.data.setdefault("traffic_taken", []):
            self.data["traffic_taken"].append(record["id"])

    def crown(self, champion: Optional[dict[str, Any]]) -> None:
        """`champion` (None: the base model) is the line's policy in production from now on."""
        self.data["champion"] = champion
        self.data["champions"].append({**(champion or {"run_id": None, "iteration": 0, "firing": None}),
                                       "since": now()})

    def record_served(self, served: Optional[dict[str, Any]]) -> None:
        self.data["served"] = served


def lock_is_held(directory: Path) -> bool:
    """Whether a process holds the line's lock now (a firing or rollback in progress)."""
    return run_is_locked(Path(directory))


@contextlib.contextmanager
def line_lock(directory: Path, timeout: float, on_wait: Optional[Callable[[str], None]] = None,
              poll_s: float = 0.5) -> Iterator[None]:
    """The line's lock (one firing or rollback at a time), waited for up to `timeout` seconds; LineBusyError then,
    naming the holder. A killed holder's lock is free at once (the kernel drops it with the process)."""
    directory.mkdir(parents=True, exist_ok=True)
    handle = open(directory / ".lock", "a+")
    deadline = time.monotonic() + timeout
    told = False
    try:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                if time.monotonic() >= deadline:
                    raise LineBusyError(f"line {directory.name} is busy ({holder}) and stayed so for {timeout:.0f} s "
                                        "(recurring.wait_timeout)") from None
                if not told and on_wait is not None:
                    on_wait(holder)
                    told = True
                time.sleep(poll_s)
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} since {now()}")
        handle.flush()
        yield
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()
