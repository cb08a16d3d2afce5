"""The traffic log: the chat completions an inference server served and the feedback its users gave, as files that a
crash of the server cannot corrupt (issue #51). Pure file handling: the server writes it (inference/
recording_routes.py), a firing reads it (`read_records`), and neither needs the other running.

    D/requests/<writer>-<seq:06d>.jsonl     the open journal of one writer (one server process)
    D/requests/<writer>-<seq:06d>.parquet   a journal sealed into a Parquet shard (same stem)
    D/feedback/...                          the same for feedback records

A journal line is {"sha256": <sha256 of the record's canonical JSON>, "record": {...}}; `TrafficLog.append` returns
once its lines are fsynced, so a server that acknowledges a request only after that loses, when killed, only the
requests it had not answered. The writer holds an exclusive flock on its open journal: a journal whose lock can be
taken belongs to a dead writer, and the next writer to start seals it. A shard carries, in its key-value metadata,
`content_sha256`: the sha256 over its records' canonical JSON lines in order, which a reader checks.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Iterable, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from areal_pipeline.online.traffic_records import (  # noqa: F401  (the records' names are the log's API too)
    FEEDBACK_FIELDS, FEEDBACK_SCHEMA, ID_FIELD, KINDS, REQUEST_FIELDS, REQUEST_SCHEMA, SCHEMAS, TIME_FIELD,
    canonical_json, content_sha256, normalized, prompt_sha256, record_sha256, sanitized_name, writer_name)
from areal_pipeline.utils import get_logger

logger = get_logger(__name__)

JOURNAL_SUFFIX, SHARD_SUFFIX = ".jsonl", ".parquet"
DEFAULT_ROTATE_BYTES = 64 << 20
DEFAULT_ROTATE_S = 3600.0
SEAL_RETRY_S = 60.0  # after a failed seal (a full disk), appends go on into the journal and the seal waits this long


class ShardError(RuntimeError):
    """A sealed shard that cannot be read or whose records do not match its `content_sha256`."""


# ----- journals ---------------------------------------------------------------------------------------------------
def _journal_line(record: dict) -> bytes:
    text = canonical_json(record)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    return f'{{"sha256":"{digest}","record":{text}}}\n'.encode("utf-8")


def _line_record(raw: bytes, kind: str) -> Optional[dict]:
    """The record of one journal line, or None where the line is not a `kind` record whose checksum matches."""
    try:
        line = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(line, dict) or not isinstance(line.get("record"), dict):
        return None
    if record_sha256(line["record"]) != line.get("sha256"):
        return None
    try:
        return normalized(line["record"], kind)
    except ValueError:
        return None


def _read_journal(path: Path, kind: str) -> tuple[list[dict], list[int], bool]:
    """(its valid records, the numbers of invalid lines that are not the last: corruption, whether the last line was
    dropped: torn by a crash mid-write, or being written now)."""
    lines = path.read_bytes().split(b"\n")
    complete, tail = lines[:-1], lines[-1]  # tail: what follows the last newline (empty unless torn)
    records, corrupt, dropped_last = [], [], bool(tail)
    for number, raw in enumerate(complete, 1):
        record = _line_record(raw, kind)
        if record is not None:
            records.append(record)
        elif number == len(complete) and not tail:
            dropped_last = True
        else:
            corrupt.append(number)
    return records, corrupt, dropped_last


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    """Whether `path` still names the file open as `fd` (a journal sealed and removed meanwhile does not)."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _seal(journal: Path, kind: str) -> Optional[Path]:
    """Seal a journal whose lock the caller holds into `<stem>.parquet` (nothing for an empty one), then remove it."""
    records, corrupt, dropped_last = _read_journal(journal, kind)
    if corrupt:
        logger.warning("traffic journal %s: line(s) %s are corrupt (bad JSON, checksum or fields); sealed without them",
                       journal, ", ".join(map(str, corrupt)))
    if dropped_last:
        logger.info("traffic journal %s: its last line was torn (a writer died mid-append); dropped", journal)
    shard = journal.with_suffix(SHARD_SUFFIX) if records else None
    if shard is not None:
        _write_shard(shard, records, kind)
    journal.unlink()
    _fsync_dir(journal.parent)
    return shard


def _write_shard(path: Path, records: list[dict], kind: str) -> None:
    times = [r[TIME_FIELD[kind]] for r in records]
    metadata = {"content_sha256": content_sha256(records), "kind": kind, "records": str(len(records)),
                "oldest_at": repr(min(times)), "newest_at": repr(max(times))}
    table = pa.Table.from_pylist(records, schema=SCHEMAS[kind]).replace_schema_metadata(metadata)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            pq.write_table(table, f, compression="zstd", write_page_checksum=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)


def recover_journals(directory: str | os.PathLike, kinds: Iterable[str] = KINDS) -> list[str]:
    """Seal every journal whose writer is dead (its lock can be taken); returns the shards written."""
    sealed = []
    for kind in kinds:
        folder = Path(directory) / kind
        for journal in sorted(folder.glob(f"*{JOURNAL_SUFFIX}")) if folder.is_dir() else []:
            try:
                fd = os.open(journal, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # its writer is alive
                if not _same_file(fd, journal):
                    continue
                for leftover in folder.glob(f".{journal.stem}{SHARD_SUFFIX}.tmp-*"):  # a seal cut short
                    leftover.unlink(missing_ok=True)
                shard = _seal(journal, kind)
                logger.info("sealed the journal %s of a writer no longer running into %s", journal, shard)
                if shard is not None:
                    sealed.append(str(shard))
            finally:
                os.close(fd)
    return sealed


# ----- shards -----------------------------------------------------------------------------------------------------
def _shards(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.glob(f"*{SHARD_SUFFIX}") if not p.name.startswith("."))


def read_shard(path: Path, kind: str) -> list[dict]:
    """A sealed shard's records, checked against its `content_sha256` (ShardError otherwise)."""
    try:
        shard = pq.ParquetFile(path, page_checksum_verification=True)
        metadata = shard.schema_arrow.metadata or {}
        table = shard.read()
    except FileNotFoundError:
        raise
    except Exception as e:  # whatever a damaged file makes pyarrow raise
        raise ShardError(f"{path}: unreadable Parquet ({type(e).__name__}: {e})") from None
    if not table.schema.remove_metadata().equals(SCHEMAS[kind]):
        raise ShardError(f"{path}: its columns ({table.schema.remove_metadata()}) are not those of a {kind} shard")
    records = table.to_pylist()
    expected = metadata.get(b"content_sha256", b"").decode()
    if content_sha256(records) != expected:
        raise ShardError(f"{path}: its records do not match its content_sha256 {expected or '(missing)'}")
    return records


def read_records(directory: str | os.PathLike, kind: str) -> tuple[list[dict], list[str]]:
    """(every record of `kind` under `directory`, problems): the records of sealed shards that verify and every
    complete valid line of open journals (read without their lock; a line being written is skipped), each record once
    (a journal sealed while it is read is seen twice), sorted by time then id. A problem names a shard that failed
    its check, or a corrupt journal line, as "<path>: <what is wrong>"; its records are left out."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    folder = Path(directory) / kind
    found, problems = [], []
    # journals before shards: one sealed meanwhile is then found as a shard
    for journal in sorted(folder.glob(f"*{JOURNAL_SUFFIX}")) if folder.is_dir() else []:
        try:
            records, corrupt, _ = _read_journal(journal, kind)
        except FileNotFoundError:
            continue
        found += records
        problems += [f"{journal}: line {n} is corrupt (bad JSON, checksum or fields)" for n in corrupt]
    for shard in _shards(folder):
        try:
            found += read_shard(shard, kind)
        except FileNotFoundError:  # removed by retention meanwhile
            continue
        except ShardError as e:
            problems.append(str(e))
    key, at = ID_FIELD[kind], TIME_FIELD[kind]
    unique = list({r[key]: r for r in reversed(found)}.values())  # the first seen of each id
    unique.sort(key=lambda r: (r[at], r[key]))
    return unique, problems


def _newest_at(shard: Path, kind: str) -> Optional[float]:
    try:
        metadata = pq.read_schema(shard).metadata or {}
        if b"newest_at" in metadata:
            return float(metadata[b"newest_at"])
        times = pq.read_table(shard, columns=[TIME_FIELD[kind]]).column(0).to_pylist()
        return max(times) if times else None
    except FileNotFoundError:
        return None
    except Exception as e:  # kept: a shard that cannot be judged is not deleted
        logger.warning("traffic shard %s is unreadable (%s); retention keeps it", shard, e)
        return None


def remove_older_than(directory: str | os.PathLike, days: float, now: Optional[float] = None) -> list[str]:
    """Retention: remove the sealed shards (of both kinds) whose newest record is older than `days` days; 0 keeps
    everything. Open journals are never removed. Returns the removed paths."""
    if not days or days <= 0:
        return []
    cutoff = (time.time() if now is None else now) - days * 86400.0
    removed = []
    for kind in KINDS:
        folder = Path(directory) / kind
        for shard in _shards(folder):
            newest = _newest_at(shard, kind)
            if newest is not None and newest < cutoff:
                shard.unlink(missing_ok=True)
                removed.append(str(shard))
        if removed and folder.is_dir():
            _fsync_dir(folder)
    if removed:
        logger.info("traffic log retention (%g days) removed %d shard(s)", days, len(removed))
    return removed


# ----- the writer -------------------------------------------------------------------------------------------------
class TrafficLog:
    """One writer's log of one kind under `directory`: appends go to its open journal, which is sealed into a shard
    when it passes `rotate_bytes` or `rotate_s` seconds of age, and on `close`. Construction seals the journals of
    dead writers and applies retention (`retention_days`, 0: keep forever). Thread-safe; `append` is blocking I/O."""

    def __init__(self, directory: str | os.PathLike, kind: str, writer: str,
                 rotate_bytes: int = DEFAULT_ROTATE_BYTES, rotate_s: float = DEFAULT_ROTATE_S,
                 retention_days: float = 0.0):
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
        if rotate_bytes < 1 or not rotate_s > 0 or not math.isfinite(retention_days) or retention_days < 0:
            raise ValueError(f"rotate_bytes={rotate_bytes} and rotate_s={rotate_s} must be positive, "
                             f"retention_days={retention_days} >= 0")
        self.directory, self.kind, self.writer = Path(directory), kind, sanitized_name(writer)
        self.folder = self.directory / kind
        self.rotate_bytes, self.rotate_s, self.retention_days = rotate_bytes, rotate_s, retention_days
        self._lock = threading.Lock()
        self._fd: Optional[int] = None  # the open journal, locked
        self._path: Optional[Path] = None
        self._size, self._opened_at, self._seal_failed_at = 0, 0.0, -math.inf
        self._closed = False
        self.folder.mkdir(parents=True, exist_ok=True)
        taken = [int(m.group(1)) for p in self.folder.iterdir()
                 if (m := re.fullmatch(re.escape(self.writer) + r"-(\d{6,})\..*", p.name))]
        self._seq = max(taken, default=-1) + 1
        recover_journals(self.directory)
        remove_older_than(self.directory, retention_days)

    def append(self, record: dict) -> None:
        self.append_many([record])

    def append_many(self, records: list[dict]) -> None:
        """Write the records to the open journal and fsync them (one fsync for all): on return they survive a crash."""
        data = b"".join(_journal_line(normalized(r, self.kind)) for r in records)
        if not data:
            return
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self.kind} traffic log of {self.writer} is closed")
            now = time.time()
            if self._fd is not None and now - self._opened_at >= self.rotate_s:
                self._try_seal(now)
            if self._fd is None:
                self._start_journal(now)
            self._write(data)
            if self._size >= self.rotate_bytes:
                self._try_seal(now)

    def maybe_rotate(self, now: Optional[float] = None) -> Optional[str]:
        """Seal the open journal if it is older than `rotate_s`; the shard written, if any."""
        now = time.time() if now is None else now
        with self._lock:
            if self._fd is not None and now - self._opened_at >= self.rotate_s:
                return self._try_seal(now)
        return None

    def close(self) -> Optional[str]:
        """Seal the open journal (the shard written, if any); appends after this are refused."""
        with self._lock:
            self._closed = True
            return self._seal_open() if self._fd is not None else None

    def __enter__(self) -> "TrafficLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start_journal(self, now: float) -> None:
        while True:
            path = self.folder / f"{self.writer}-{self._seq:06d}{JOURNAL_SUFFIX}"
            self._seq += 1
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o644)
            except FileExistsError:
                continue
            try:  # a recovery that locked it first has sealed (removed) it: take the next name
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                ours = _same_file(fd, path)
            except BlockingIOError:
                ours = False
            if ours:
                break
            os.close(fd)
        _fsync_dir(self.folder)  # the journal's name is durable before any append is acknowledged
        self._fd, self._path, self._size, self._opened_at = fd, path, 0, now

    def _write(self, data: bytes) -> None:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            os.fsync(self._fd)
        except OSError:
            # A partial line left in the middle of the journal would read as corruption: cut it off, or, where that
            # fails too, leave this journal to recovery (its torn line is then the last) and start another.
            try:
                os.ftruncate(self._fd, self._size)
                os.fsync(self._fd)
            except OSError:
                os.close(self._fd)
                self._fd = self._path = None
            raise
        self._size += len(data)

    def _try_seal(self, now: float) -> Optional[str]:
        if now - self._seal_failed_at < SEAL_RETRY_S:
            return None
        try:
            return self._seal_open()
        except Exception:
            self._seal_failed_at = now
            logger.exception("could not seal the traffic journal %s; appends go on into it", self._path)
            return None

    def _seal_open(self) -> Optional[str]:
        shard = _seal(self._path, self.kind)
        os.close(self._fd)  # the lock is released only once the journal is gone
        self._fd = self._path = None
        try:
            remove_older_than(self.directory, self.retention_days)
        except OSError:
            logger.exception("traffic log retention failed; the next rotation tries again")
        return None if shard is None else str(shard)
