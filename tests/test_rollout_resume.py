"""The episode journal (rollout/journal.py): an interrupted rollout resumes where it stopped, and ends with the
shards an uninterrupted one writes (`content_sha256`), in-process, after kill -9, and in asynchronous mode."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from areal_pipeline.data.shards import content_sha256, read_manifest, read_table, read_trajectories
from areal_pipeline.data.trajectory import Trajectory
from areal_pipeline.rollout.executor import select_batch
from areal_pipeline.rollout.failures import EpisodeFailure, FailurePolicy, GroupResult, RolloutFailureRate
from areal_pipeline.rollout.journal import EpisodeJournal, episodes_digest, finish_rollout
from areal_pipeline.run_spec import load_config


def _trajectory(prompt_id: str, i: int, version: int = 0, reward: float = 0.1) -> Trajectory:
    return Trajectory(prompt_id=prompt_id, group_id=prompt_id, sample_idx=i, input_ids=[5, 6, 7 + i],
                      loss_mask=[0, 1, 1], logprobs=[0.0, -0.3, -1 / 3], versions=[-1, version, version],
                      reward=reward, text=f"t{i}", metadata={"answer": "7", "latency": 0.01 * i, "server": "a:1"})


def _slots(n: int = 4) -> dict[int, dict]:
    return {slot: {"prompt_id": f"p{slot}", "sampling_seed": 100 + slot} for slot in range(n)}


def _group(slot: int, version: int = 0, **kw) -> GroupResult:
    return GroupResult(slot, f"p{slot}", [_trajectory(f"p{slot}", i, version) for i in range(2)], **kw)


def _journal(tmp_path: Path, digest: str = "d1") -> EpisodeJournal:
    return EpisodeJournal(tmp_path / "iter_1" / "rollout.episodes", run_id="r", iteration=1, batch_size=4,
                          digest=digest)


def test_groups_written_are_loaded_back_with_their_outcome_and_failures(tmp_path):
    slots, journal = _slots(), _journal(tmp_path)
    journal.open()
    write = journal.writer(slots)
    failure = EpisodeFailure("retrieval", True, "HTTP 503", peer="127.0.0.1:9", sample_idx=1, attempt=3)
    write(_group(0))
    write(GroupResult(2, "p2", [], failures=[failure], retried=[failure], outcome="dropped"))
    loaded = _journal(tmp_path).load(slots)
    assert sorted(loaded) == [0, 2]
    assert loaded[2].trajectories == [] and loaded[2].outcome == "dropped"
    assert loaded[2].failures == [failure] and loaded[2].retried == [failure]
    assert pq.read_table(journal.path(2)).num_rows == 0  # a dropped group is a file of no rows
    got = loaded[0].trajectories
    assert [(t.prompt_id, t.sample_idx, t.input_ids, t.metadata) for t in got] == [
        (t.prompt_id, t.sample_idx, t.input_ids, t.metadata) for t in _group(0).trajectories]
    # what comes back went through the shards' float32 columns
    assert got[0].logprobs[2] == float(torch.tensor(-1 / 3, dtype=torch.float32)) != -1 / 3


def test_a_corrupt_or_foreign_group_file_is_deleted_and_named(tmp_path, caplog):
    slots, journal = _slots(), _journal(tmp_path)
    journal.open()
    for slot in range(3):
        journal.writer(slots)(_group(slot))
    data = journal.path(0).read_bytes()
    journal.path(0).write_bytes(data[: len(data) // 2])  # truncated
    # the group of another prompt at position 1 (another batch's file)
    journal.writer({1: {"sampling_seed": 101}})(GroupResult(1, "other", _group(1).trajectories))
    caplog.set_level(logging.WARNING, logger="areal_pipeline")
    loaded = journal.load(slots)
    assert sorted(loaded) == [2]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(journal.path(0)) in w for w in warnings), warnings
    assert any(str(journal.path(1)) in w and "'other'" in w for w in warnings), warnings
    assert not journal.path(0).exists() and not journal.path(1).exists() and journal.path(2).exists()


def test_a_bit_flip_in_a_group_is_caught_by_its_digest(tmp_path, caplog):
    slots, journal = _slots(), _journal(tmp_path)
    journal.open()
    journal.writer(slots)(GroupResult(0, "p0", [_trajectory("p0", 0, reward=0.25)]))
    data = bytearray(journal.path(0).read_bytes())
    import struct

    at = bytes(data).index(struct.pack("<f", 0.25))  # the reward's float32, uncompressed in the data page
    data[at: at + 4] = struct.pack("<f", 0.75)
    journal.path(0).write_bytes(bytes(data))
    caplog.set_level(logging.WARNING, logger="areal_pipeline")
    assert journal.load(slots) == {}
    assert any(str(journal.path(0)) in r.getMessage() and "digest" in r.getMessage() for r in caplog.records)


def test_a_journal_of_other_settings_is_cleared(tmp_path, caplog):
    base = ["rollout.batch_size=4"]
    digest = episodes_digest(load_config(None, base))
    assert digest == episodes_digest(load_config(None, base))
    assert digest != episodes_digest(load_config(None, [*base, "rollout.gconfig.temperature=0.5"]))
    assert digest != episodes_digest(load_config(None, [*base, "seed=2"]))
    slots = _slots()
    old = _journal(tmp_path, digest)
    old.open()
    old.writer(slots)(_group(0))
    assert sorted(_journal(tmp_path, digest).load(slots)) == [0]
    changed = episodes_digest(load_config(None, [*base, "rollout.gconfig.temperature=0.5"]))
    caplog.set_level(logging.WARNING, logger="areal_pipeline")
    assert _journal(tmp_path, changed).load(slots) == {}
    assert not old.path(0).exists()
    assert any("other settings (digest)" in r.getMessage() for r in caplog.records)
    assert json.loads((old.directory / "journal.json").read_text())["digest"] == changed


def test_groups_older_than_the_staleness_bound_are_played_again(tmp_path):
    slots, journal = _slots(), _journal(tmp_path)
    journal.open()
    journal.writer(slots)(_group(0, version=1))
    journal.writer(slots)(_group(1, version=2))
    assert sorted(journal.load(slots, oldest_version=2)) == [1]
    assert not journal.path(0).exists()


def test_resumed_and_uninterrupted_rollouts_write_the_same_content(tmp_path):
    policy = FailurePolicy()
    groups = [_group(slot) for slot in range(4)]
    straight = finish_rollout(groups, tmp_path / "a" / "rollout", _journal(tmp_path / "a"), policy=policy,
                              n_samples=2, seconds=1.0, rows_per_shard=3)
    journal = _journal(tmp_path / "b")
    journal.open()
    for g in groups[:3]:
        journal.writer(_slots())(g)
    loaded = journal.load(_slots())
    resumed = finish_rollout([groups[3], *loaded.values()], tmp_path / "b" / "rollout", journal, policy=policy,
                             n_samples=2, seconds=7.0, rows_per_shard=3)
    assert not journal.directory.exists()  # removed once the shards are written
    assert resumed["content_sha256"] == straight["content_sha256"] == content_sha256(read_table(tmp_path / "a" / "rollout"))
    assert {k: v for k, v in resumed["stats"].items() if "seconds" not in k and "per_s" not in k} == {
        k: v for k, v in straight["stats"].items() if "seconds" not in k and "per_s" not in k}
    assert [t.prompt_id for t in read_trajectories(tmp_path / "b" / "rollout")] == ["p0", "p0", "p1", "p1", "p2",
                                                                                  "p2", "p3", "p3"]
    # the digest leaves out what differs between any two runs, and nothing else
    other = _group(1)
    other.trajectories[0].metadata["latency"] = 9.0
    assert content_sha256(_table([other])) == content_sha256(_table([_group(1)]))
    other.trajectories[0].logprobs[1] = -0.31
    assert content_sha256(_table([other])) != content_sha256(_table([_group(1)]))


def _table(groups):
    from areal_pipeline.data.shards import trajectory_table

    return trajectory_table([t for g in groups for t in g.trajectories], "r", 1)


def test_past_the_failure_rate_only_the_failed_groups_are_played_again(tmp_path):
    journal, slots = _journal(tmp_path), _slots()
    journal.open()
    failure = EpisodeFailure("reward_crash", True, "worker died", peer="reward worker 3", sample_idx=0)
    groups = [_group(0), _group(1), GroupResult(2, "p2", [], failures=[failure] * 2, outcome="dropped"), _group(3)]
    for g in groups:
        journal.writer(slots)(g)
    with pytest.raises(RolloutFailureRate, match=r"iteration 1: 2/8 episodes failed: reward_crash 2 @reward worker 3"):
        finish_rollout(groups, tmp_path / "rollout", journal, policy=FailurePolicy(max_failure_rate=0.2),
                       n_samples=2, seconds=1.0, rows_per_shard=4)
    assert sorted(journal.load(slots)) == [0, 1, 3]
    manifest = finish_rollout(groups, tmp_path / "rollout", journal, policy=FailurePolicy(max_failure_rate=0.5),
                              n_samples=2, seconds=1.0, rows_per_shard=4)
    assert manifest["num_rows"] == 6 and manifest["stats"]["groups_dropped"] == 1
    assert manifest["stats"]["failures/reward_crash"] == 2 and manifest["stats"]["failure_rate"] == 0.25
    assert manifest["failures"][0] == {"slot": 2, "prompt_id": "p2", **failure.as_record()}
