"""The episode journal: an interrupted rollout resumes where it stopped.

Every group of an iteration's rollout is appended to the journal as it ends, so that a killed command, a retried
node or a restarted asynchronous executor plays only the groups that are missing:

    iter_k/rollout.episodes/journal.json           written first: the format, run_id, k, the batch size and a digest
                                                   of what determines the episodes (sampling, workflow and agent,
                                                   model, data set, seed)
    iter_k/rollout.episodes/segment-00001.arrows   the groups one opening of the journal wrote, in the order they
                                                   ended: an Arrow IPC stream of TRAJECTORY_SCHEMA record batches, a
                                                   batch a group (no rows for a dropped one), each with the group's
                                                   record in its custom metadata: batch position, prompt, its seed,
                                                   the outcome, the failures and retried attempts, a digest of the
                                                   batch's encoding. A record marked `discarded` takes its
                                                   position's group back.

One file appended to, not a file per group: a rollout of thousands of groups is one create and a few thousand
appends, not thousands of files created, renamed and deleted (a metadata storm on NFS or Lustre). A writer thread
appends the groups and shares one fsync among those that ended while it wrote, off the event loop that dispatches
the requests. A group counts once its fsync is done: one that ended just before a kill may be missing, and is
played again (episodes are seeded, so it comes back the same).

The writer holds the groups in memory for `rollout.journal_delay` seconds before it first touches the disk (the
header, the segment, the first fsync): a group played in a rollout's first seconds is cheaper to play again than to
journal, and a rollout shorter than that (the embedded default's) writes and removes no journal at all. A flush (a
discard, a load by a retry, a close) writes what is queued at once.

Each opening writes a segment of its own, so nothing is ever appended after a torn tail. Loading reads the segments
in order, a later record of a batch position replacing an earlier one, and checks each record (its rows match their
digest, it is the group of that batch position's prompt and seed); one that fails is left out with a warning naming
the segment and the position, and its group is played again. A torn or unreadable tail ends a segment. A journal of
other settings, or of another format, is cleared whole. Nothing here is unpickled: Arrow IPC and JSON only.

When every group is there, `finish_rollout` assembles them in batch order as one table, checks the failure rate,
computes the stats from that table (so that a resumed rollout's stats went through the same float32 columns as an
uninterrupted one's), writes the shards (manifest last, with `content_sha256`) and then removes the journal.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pyarrow as pa

from areal_pipeline.data.shards import (TRAJECTORY_SCHEMA, content_sha256, table_trajectories, trajectory_table,
                                        with_stored_rewards, write_table)
from areal_pipeline.rollout.executor import rollout_stats
from areal_pipeline.rollout.failures import (EpisodeFailure, FailurePolicy, GroupResult, RolloutFailureRate,
                                             check_failure_rate, failure_records)
from areal_pipeline.utils import atomic_write_text, get_logger

logger = get_logger(__name__)

JOURNAL_NAME = "journal.json"
JOURNAL_FORMAT = 2  # 1: a Parquet file per group
SEGMENT_PATTERN = "segment-*.arrows"
META_KEY = b"areal_pipeline.group"
# How long a flush waits for the writer thread: the groups queued before it, appended and fsynced.
FLUSH_TIMEOUT_S = 300.0


def episodes_digest(cfg: Any) -> str:
    """A digest of the settings that determine an iteration's episodes: a journal written under others is void."""
    import dataclasses

    r = cfg.rollout
    what = {"gconfig": dataclasses.asdict(r.gconfig), "workflow": r.workflow, "agent": dataclasses.asdict(r.agent),
            "model": dataclasses.asdict(cfg.model), "dataset": dataclasses.asdict(cfg.dataset), "seed": cfg.seed,
            "batch_size": r.batch_size}
    if r.group_reward:  # the rewards the journal holds are the group reward's
        j = cfg.judge
        what["group_reward"] = {"name": r.group_reward, "judge": [j.base_url, j.model, j.temperature, j.max_tokens,
                                                                  j.include_reference]}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


class EpisodeJournal:
    """One iteration's journal. Writes are queued to a writer thread (started on the first write); `load`, `discard`
    and `flush` wait for what was queued before them; `close` or `remove` ends the thread."""

    def __init__(self, directory: Path, *, run_id: str, iteration: int, batch_size: int, digest: str,
                 delay_s: float = 0.0):
        self.directory = Path(directory)
        self.header = {"format": JOURNAL_FORMAT, "run_id": run_id, "iteration": iteration, "batch_size": batch_size,
                       "digest": digest}
        self.run_id, self.iteration = run_id, iteration
        self.delay_s = delay_s  # rollout.journal_delay: how long the writer holds groups before it first writes
        self._writer: Optional[SegmentWriter] = None
        self._lock = threading.RLock()  # opening a journal of other settings closes the writer under it

    def open(self) -> None:
        """Start the journal, or keep the one on disk where it was written under the same settings."""
        if self._clear_if_foreign():
            atomic_write_text(self.directory / JOURNAL_NAME, json.dumps(self.header, sort_keys=True) + "\n")

    def _clear_if_foreign(self) -> bool:
        """Clear a journal on disk written under other settings; whether the header is still to be written."""
        path = self.directory / JOURNAL_NAME
        try:
            found = json.loads(path.read_text()) if path.is_file() else None
        except (OSError, ValueError):
            found = {}
        if found == self.header:
            return False
        if found is not None:
            logger.warning("the episode journal %s was written under other settings (%s): clearing it", self.directory,
                           ", ".join(sorted(k for k in self.header if found.get(k) != self.header[k])) or "unreadable")
            self.remove()
        return True

    def segments(self) -> list[Path]:
        return sorted(self.directory.glob(SEGMENT_PATTERN))

    def load(self, slots: dict[int, dict[str, Any]], oldest_version: Optional[int] = None) -> dict[int, GroupResult]:
        """The groups of `slots` (batch position -> seeded record) on disk, checked; a record that fails a check is
        left out with a warning, and its position discarded. `oldest_version`: a group with a generated token of an
        older policy version is discarded too (asynchronous mode: its staleness would pass the bound)."""
        try:
            self.flush()
        except (OSError, TimeoutError) as error:  # what it failed to write is played again
            logger.warning("%s: starting a new segment", error)
            self.close(raise_errors=False)
        self._clear_if_foreign()  # the header is the writer's to write, when it first writes
        last_records = {slot: (segment, meta, batch) for segment in self.segments()
                        for slot, meta, batch in _records(segment) if slot in slots}
        groups, unusable, stale = {}, [], []
        for slot, (segment, meta, batch) in sorted(last_records.items()):
            if meta.get("discarded"):
                continue
            try:
                group = _group(meta, batch, slot, slots[slot])
            except Exception as error:  # whatever is wrong with it, the group is played again
                logger.warning("episode journal: %s: the group at batch position %d is unusable (%s): it is "
                               "played again", segment, slot, error)
                unusable.append(slot)
                continue
            oldest = min((v for t in group.trajectories for v, m in zip(t.versions, t.loss_mask) if m), default=None)
            if oldest_version is not None and oldest is not None and oldest < oldest_version:
                logger.info("episode journal %s: the group at batch position %d has tokens of policy version %d, "
                            "older than %d allows: playing it again", self.directory, slot, oldest, oldest_version)
                stale.append(slot)
                continue
            groups[slot] = group
        self.discard(unusable + stale)
        return groups

    def write(self, group: GroupResult, sampling_seed: Optional[int] = None) -> None:
        """Queue a finished group for the journal (it replaces any earlier one of its position). `sampling_seed`: the
        seed of the batch position's prompt (the record's), checked when the group is loaded."""
        self._segment_writer().put(("group", group, sampling_seed))

    def writer(self, slots: dict[int, dict[str, Any]]):
        """`write` as an `on_group` callback of `executor.play_batch` for the records `slots`."""
        return lambda group: self.write(group, slots[group.slot].get("sampling_seed"))

    def discard(self, slots: list[int]) -> None:
        """Take back the groups of these batch positions (they are played again); on disk when this returns."""
        if slots:
            writer = self._segment_writer()
            for slot in slots:
                writer.put(("discard", slot, None))
            writer.flush()

    def flush(self) -> None:
        """Wait until every group queued so far is on disk; raises the writer's error where it failed."""
        with self._lock:
            writer = self._writer
        if writer is not None:
            writer.flush()

    def close(self, raise_errors: bool = True) -> None:
        """Flush and end the writer thread (a later write starts another, on a new segment)."""
        with self._lock:
            writer, self._writer = self._writer, None
        if writer is None:
            return
        try:
            writer.close()
        except (OSError, TimeoutError) as error:
            if raise_errors:
                raise
            logger.warning("%s", error)

    def remove(self) -> None:
        """Delete the journal; what is still queued is never written (the shards written from the groups in memory
        make it moot: at the end of a rollout, the groups that ended last need not wait for their fsync)."""
        with self._lock:
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.abandon()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _segment_writer(self) -> "SegmentWriter":
        writer = self._writer  # without the lock, which the writer's thread holds while it opens the journal on disk:
        if writer is not None:  # a write is called on the rollout's event loop and must not wait for that
            return writer
        with self._lock:
            if self._writer is None:
                self._writer = SegmentWriter(self._new_segment, self.run_id, self.iteration, delay_s=self.delay_s)
            return self._writer

    def _new_segment(self) -> Path:
        """The writer's segment, when it first writes: the header written (where it is not on disk), then the
        segment created."""
        with self._lock:
            self.open()
            return _new_segment(self.directory)


def _new_segment(directory: Path) -> Path:
    """The next segment's path, created empty (exclusively: two writers never share one)."""
    numbers = [int(p.stem.split("-")[1]) for p in directory.glob(SEGMENT_PATTERN) if p.stem.split("-")[1].isdigit()]
    number = max(numbers, default=0) + 1
    while True:
        path = directory / f"segment-{number:05d}.arrows"
        try:
            path.touch(exist_ok=False)
            return path
        except FileExistsError:
            number += 1


class SegmentWriter:
    """Appends to one segment from a thread of its own: the records queued while it writes and fsyncs are appended
    next and share one fsync. Nothing touches the disk before `delay_s` has passed since it started, or a flush or
    close asks for it: `segment()` makes the segment then. An error (a full disk) is raised to the next `put` or
    `flush`."""

    def __init__(self, segment: Callable[[], Path], run_id: str, iteration: int, delay_s: float = 0.0):
        self._segment, self.run_id, self.iteration = segment, run_id, iteration
        self.path: Optional[Path] = None  # made when it first writes
        self._due = time.monotonic() + delay_s
        self._queue: list[tuple] = []
        self._busy = False
        self._closing = self._abandoned = self._flushing = False
        self._error: Optional[BaseException] = None
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=f"episode-journal-{iteration}", daemon=True)
        self._thread.start()

    def put(self, item: tuple) -> None:
        with self._changed:
            self._raise_if_failed()
            if self._closing:
                raise RuntimeError(f"episode journal {self.where}: written to after it was closed")
            self._queue.append(item)
            self._changed.notify_all()

    def flush(self, timeout: float = FLUSH_TIMEOUT_S) -> None:
        with self._changed:
            self._flushing = True
            self._changed.notify_all()
            if not self._changed.wait_for(lambda: self._error is not None or not (self._queue or self._busy), timeout):
                raise TimeoutError(f"episode journal {self.where}: {len(self._queue)} record(s) not written within "
                                   f"{timeout:.0f} s")
            self._raise_if_failed()

    def close(self, timeout: float = FLUSH_TIMEOUT_S) -> None:
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"episode journal {self.where}: its writer did not finish within {timeout:.0f} s")
        with self._changed:
            self._raise_if_failed()

    def abandon(self, timeout: float = FLUSH_TIMEOUT_S) -> None:
        """End the thread without writing what is queued (the journal is being deleted)."""
        with self._changed:
            self._closing, self._abandoned, self._queue = True, True, []
            self._changed.notify_all()
        self._thread.join(timeout)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise OSError(f"episode journal {self.where}: writing failed: {self._error!r}") from self._error

    def _held(self) -> bool:
        """Wait while the queued records are held in memory (`delay_s`, unless a flush or close asks for them);
        whether there is anything to write (False: closed or abandoned with nothing queued)."""
        with self._changed:
            while True:
                if self._abandoned:
                    return False
                due = self._closing or self._flushing or time.monotonic() >= self._due
                if self._queue and due:
                    return True
                if self._closing:
                    return False
                left = self._due - time.monotonic()
                self._changed.wait(left if self._queue and left > 0 else None)

    @property
    def where(self) -> str:
        return str(self.path) if self.path is not None else f"of iteration {self.iteration} (not yet on disk)"

    def _run(self) -> None:
        try:
            if not self._held():
                return
            self.path = self._segment()
            with open(self.path, "ab") as file, pa.ipc.new_stream(file, TRAJECTORY_SCHEMA) as stream:
                _fsync_directory(self.path.parent)  # the segment's name, durable before anything in it counts
                while True:
                    with self._changed:
                        self._changed.wait_for(lambda: self._queue or self._closing)
                        if not self._queue:
                            return
                        items, self._queue, self._busy = self._queue, [], True
                    for item in items:
                        if self._abandoned:
                            return
                        batch, meta = self._encode(*item)
                        stream.write_batch(batch, custom_metadata={META_KEY: json.dumps(meta).encode()})
                    file.flush()
                    os.fsync(file.fileno())
                    with self._changed:
                        self._busy = False
                        self._changed.notify_all()
        except BaseException as error:
            with self._changed:
                self._error, self._busy, self._queue = error, False, []
                self._changed.notify_all()

    def _encode(self, kind: str, what: Any, sampling_seed: Optional[int]) -> tuple[pa.RecordBatch, dict]:
        if kind == "discard":
            return _one_batch(TRAJECTORY_SCHEMA.empty_table()), {"slot": what, "discarded": True}
        group: GroupResult = what
        table = trajectory_table(group.trajectories, self.run_id, self.iteration).replace_schema_metadata(None)
        meta = {"slot": group.slot, "prompt_id": group.prompt_id, "replaced_prompt_id": group.replaced_prompt_id,
                "sampling_seed": sampling_seed, "outcome": group.outcome,
                "failures": [f.as_record() for f in group.failures],
                "retried": [f.as_record() for f in group.retried], "episodes": group.episodes, "judged": group.judged,
                "rows": table.num_rows}
        batch = _one_batch(table)
        meta["batch_sha256"] = batch_digest(batch)
        return batch, meta


def _one_batch(table: pa.Table) -> pa.RecordBatch:
    """The table as one record batch (one of no rows where the table has none)."""
    return pa.RecordBatch.from_arrays([column.combine_chunks() for column in table.columns], schema=table.schema)


def batch_digest(batch: pa.RecordBatch) -> str:
    """sha256 of a record batch's Arrow IPC encoding: the same for the batch written and the batch read back, and a
    fraction of the cost of a digest of its values."""
    return hashlib.sha256(batch.serialize()).hexdigest()


def _fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _records(segment: Path):
    """(batch position, record, rows) of each record of a segment in order, up to a torn or unreadable tail."""
    if segment.stat().st_size == 0:  # created, nothing written before a kill
        return
    with pa.OSFile(str(segment)) as source:
        try:
            reader = pa.ipc.open_stream(source)
            while True:
                try:
                    batch, custom = reader.read_next_batch_with_custom_metadata()
                except StopIteration:
                    return
                try:
                    meta = json.loads(custom[META_KEY])
                    slot = int(meta["slot"])
                except Exception as error:
                    logger.warning("episode journal: %s: a record without a readable batch position (%r): left out",
                                   segment, error)
                    continue
                yield slot, meta, batch
        except (pa.ArrowInvalid, OSError) as error:
            logger.warning("episode journal: %s ends in a torn or unreadable record (%s): the groups after it are "
                           "played again", segment, error)


def _group(meta: dict[str, Any], batch: pa.RecordBatch, slot: int, record: dict[str, Any]) -> GroupResult:
    if batch.num_rows != meta["rows"] or batch_digest(batch) != meta["batch_sha256"]:
        raise ValueError("its rows do not match their digest")
    table = pa.Table.from_batches([batch])
    prompt = meta["replaced_prompt_id"] if meta["outcome"] == "refilled" else meta["prompt_id"]
    if (meta["slot"], prompt, meta["sampling_seed"]) != (slot, record.get("prompt_id"), record.get("sampling_seed")):
        raise ValueError(f"it holds prompt {prompt!r} seeded {meta['sampling_seed']} at position {meta['slot']}, "
                         f"not prompt {record.get('prompt_id')!r} seeded {record.get('sampling_seed')}")
    return GroupResult(slot, meta["prompt_id"], table_trajectories(table),
                       failures=[EpisodeFailure.from_record(f) for f in meta["failures"]],
                       retried=[EpisodeFailure.from_record(f) for f in meta["retried"]],
                       outcome=meta["outcome"], replaced_prompt_id=meta["replaced_prompt_id"],
                       episodes=meta.get("episodes", 0), judged=meta.get("judged", True))


def finish_rollout(groups: list[GroupResult], out: Path, journal: EpisodeJournal, *, policy: FailurePolicy,
                   seconds: float, rows_per_shard: int,
                   extra_manifest: Optional[dict] = None, extra_stats: Optional[dict] = None) -> dict[str, Any]:
    """An iteration's groups (every batch position's) -> its rollout shards; the manifest (returned) gets the stats,
    the failures and `content_sha256`. Past `policy.max_failure_rate`, RolloutFailureRate, after the failed groups
    are discarded from the journal: a retry plays those again and keeps the others (and judges again, not plays,
    those the judge dropped: `GroupResult.judge_failed`)."""
    groups = sorted(groups, key=lambda g: g.slot)
    run_id, k = journal.run_id, journal.iteration
    unjudged = [g.slot for g in groups if not g.judged]
    if unjudged:
        raise RuntimeError(f"iteration {k}: the groups at batch positions {unjudged} were never scored by the group "
                           "reward (rollout.group_reward)")
    try:
        check_failure_rate(k, groups, policy)
    except RolloutFailureRate:
        journal.discard([g.slot for g in groups if g.failures and not g.judge_failed])
        raise
    trajectories = [t for g in groups for t in g.trajectories]
    table = trajectory_table(trajectories, run_id, k)
    stats = {**rollout_stats(with_stored_rewards(trajectories, table), seconds, groups), **(extra_stats or {})}
    manifest = write_table(table, out, run_id=run_id, iteration=k, rows_per_shard=rows_per_shard, overwrite=True,
                           extra_manifest={"stats": stats, "failures": failure_records(groups),
                                           "content_sha256": content_sha256(table), **(extra_manifest or {})})
    journal.remove()
    logger.info("rollout %s iter %d: %d trajectories, reward %.3f, %.0f tok/s", run_id, k, len(trajectories),
                stats["reward_mean"], stats["rollout_tokens_per_s"])
    return manifest
