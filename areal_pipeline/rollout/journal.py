"""The episode journal: an interrupted rollout resumes where it stopped.

Every group of an iteration's rollout is written to disk as it ends, so that a killed command, a retried node or a
restarted asynchronous executor plays only the groups that are missing:

    iter_k/rollout.episodes/journal.json        written first: run_id, k, the batch size and a digest of what
                                                determines the episodes (sampling, workflow and agent, model,
                                                data set, seed)
    iter_k/rollout.episodes/g-00003.parquet     batch position 3's group: TRAJECTORY_SCHEMA rows (none when it
                                                was dropped) and, in the file's key-value metadata, the prompt,
                                                its seed, the outcome, the failures and retried attempts and a
                                                digest of the rows

The directory sits beside `iter_k/rollout/`, never inside it, so that clearing unfinished shards never touches it.
Each file is written atomically. Loading checks each one (it parses, its rows match their digest, it is the group
of that batch position's prompt and seed) and deletes, with a warning naming it, one that fails: its group is
played again, and episodes are seeded, so it comes back the same. A journal of other settings is cleared whole.
Nothing here is unpickled: Parquet and JSON only.

When every group is there, `finish_rollout` assembles them in batch order as one table, checks the failure rate,
computes the stats from that table (so that a resumed rollout's stats went through the same float32 columns as an
uninterrupted one's), writes the shards (manifest last, with `content_sha256`) and then removes the journal.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, Optional

import pyarrow as pa
import pyarrow.parquet as pq

from areal_pipeline.data.shards import (TRAJECTORY_SCHEMA, content_sha256, table_trajectories, trajectory_table,
                                        write_table)
from areal_pipeline.rollout.executor import rollout_stats
from areal_pipeline.rollout.failures import (EpisodeFailure, FailurePolicy, GroupResult, RolloutFailureRate,
                                             check_failure_rate, failure_records)
from areal_pipeline.utils import atomic_write_bytes, atomic_write_text, get_logger

logger = get_logger(__name__)

JOURNAL_NAME = "journal.json"
META_KEY = b"areal_pipeline.group"


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
    def __init__(self, directory: Path, *, run_id: str, iteration: int, batch_size: int, digest: str):
        self.directory = Path(directory)
        self.header = {"run_id": run_id, "iteration": iteration, "batch_size": batch_size, "digest": digest}
        self.run_id, self.iteration = run_id, iteration

    def path(self, slot: int) -> Path:
        return self.directory / f"g-{slot:05d}.parquet"

    def open(self) -> None:
        """Start the journal, or keep the one on disk where it was written under the same settings."""
        path = self.directory / JOURNAL_NAME
        try:
            found = json.loads(path.read_text()) if path.is_file() else None
        except (OSError, ValueError):
            found = {}
        if found == self.header:
            return
        if found is not None:
            logger.warning("the episode journal %s was written under other settings (%s): clearing it", self.directory,
                           ", ".join(sorted(k for k in self.header if found.get(k) != self.header[k])) or "unreadable")
        self.remove()
        atomic_write_text(path, json.dumps(self.header, sort_keys=True) + "\n")

    def load(self, slots: dict[int, dict[str, Any]], oldest_version: Optional[int] = None) -> dict[int, GroupResult]:
        """The groups of `slots` (batch position -> seeded record) on disk, checked; a file that fails a check is
        deleted with a warning. `oldest_version`: a group with a generated token of an older policy version is
        deleted too (asynchronous mode: its staleness would pass the bound)."""
        self.open()
        groups = {}
        for slot, record in sorted(slots.items()):
            path = self.path(slot)
            if not path.is_file():
                continue
            try:
                group = self._read(path, slot, record)
            except Exception as error:  # whatever is wrong with it, the group is played again
                logger.warning("episode journal: %s is unusable (%s): deleting it, its group is played again",
                               path, error)
                path.unlink(missing_ok=True)
                continue
            oldest = min((v for t in group.trajectories for v, m in zip(t.versions, t.loss_mask) if m), default=None)
            if oldest_version is not None and oldest is not None and oldest < oldest_version:
                logger.info("episode journal: %s has tokens of policy version %d, older than %d allows: playing "
                            "its group again", path, oldest, oldest_version)
                path.unlink(missing_ok=True)
                continue
            groups[slot] = group
        return groups

    def _read(self, path: Path, slot: int, record: dict[str, Any]) -> GroupResult:
        meta = json.loads((pq.read_schema(path).metadata or {})[META_KEY])
        table = pq.read_table(path, schema=TRAJECTORY_SCHEMA).replace_schema_metadata(None)
        if table.num_rows != meta["rows"] or content_sha256(table) != meta["rows_sha256"]:
            raise ValueError("its rows do not match their digest")
        prompt = meta["replaced_prompt_id"] if meta["outcome"] == "refilled" else meta["prompt_id"]
        if (meta["slot"], prompt, meta["sampling_seed"]) != (slot, record.get("prompt_id"),
                                                             record.get("sampling_seed")):
            raise ValueError(f"it holds prompt {prompt!r} seeded {meta['sampling_seed']} at position {meta['slot']}, "
                             f"not prompt {record.get('prompt_id')!r} seeded {record.get('sampling_seed')}")
        return GroupResult(slot, meta["prompt_id"], table_trajectories(table),
                           failures=[EpisodeFailure.from_record(f) for f in meta["failures"]],
                           retried=[EpisodeFailure.from_record(f) for f in meta["retried"]],
                           outcome=meta["outcome"], replaced_prompt_id=meta["replaced_prompt_id"],
                           episodes=meta.get("episodes", 0), judged=meta.get("judged", True))

    def write(self, group: GroupResult, sampling_seed: Optional[int] = None) -> None:
        """Write a finished group (its file replaces any earlier one atomically). `sampling_seed`: the seed of the
        batch position's prompt (the record's), checked when the file is loaded."""
        table = trajectory_table(group.trajectories, self.run_id, self.iteration)
        meta = {"slot": group.slot, "prompt_id": group.prompt_id, "replaced_prompt_id": group.replaced_prompt_id,
                "sampling_seed": sampling_seed, "outcome": group.outcome,
                "failures": [f.as_record() for f in group.failures],
                "retried": [f.as_record() for f in group.retried], "episodes": group.episodes, "judged": group.judged,
                "rows": table.num_rows, "rows_sha256": content_sha256(table)}
        sink = pa.BufferOutputStream()
        pq.write_table(table.replace_schema_metadata({META_KEY: json.dumps(meta).encode()}), sink)
        atomic_write_bytes(self.path(group.slot), sink.getvalue().to_pybytes())

    def writer(self, slots: dict[int, dict[str, Any]]):
        """`write` as an `on_group` callback of `executor.play_batch` for the records `slots`."""
        return lambda group: self.write(group, slots[group.slot].get("sampling_seed"))

    def discard(self, slots: list[int]) -> None:
        for slot in slots:
            self.path(slot).unlink(missing_ok=True)

    def remove(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def finish_rollout(groups: list[GroupResult], out: Path, journal: EpisodeJournal, *, policy: FailurePolicy,
                   seconds: float, rows_per_shard: int,
                   extra_manifest: Optional[dict] = None, extra_stats: Optional[dict] = None) -> dict[str, Any]:
    """An iteration's groups (every batch position's) -> its rollout shards; the manifest (returned) gets the stats,
    the failures and `content_sha256`. Past `policy.max_failure_rate`, RolloutFailureRate, after the failed groups'
    journal files are deleted: a retry plays those again and keeps the others."""
    groups = sorted(groups, key=lambda g: g.slot)
    run_id, k = journal.run_id, journal.iteration
    unjudged = [g.slot for g in groups if not g.judged]
    if unjudged:
        raise RuntimeError(f"iteration {k}: the groups at batch positions {unjudged} were never scored by the group "
                           "reward (rollout.group_reward)")
    try:
        check_failure_rate(k, groups, policy)
    except RolloutFailureRate:
        journal.discard([g.slot for g in groups if g.failures])
        raise
    table = trajectory_table([t for g in groups for t in g.trajectories], run_id, k)
    trajectories = table_trajectories(table)
    stats = {**rollout_stats(trajectories, seconds, groups), **(extra_stats or {})}
    manifest = write_table(table, out, run_id=run_id, iteration=k, rows_per_shard=rows_per_shard, overwrite=True,
                           extra_manifest={"stats": stats, "failures": failure_records(groups),
                                           "content_sha256": content_sha256(table), **(extra_manifest or {})})
    journal.remove()
    logger.info("rollout %s iter %d: %d trajectories, reward %.3f, %.0f tok/s", run_id, k, len(trajectories),
                stats["reward_mean"], stats["rollout_tokens_per_s"])
    return manifest
