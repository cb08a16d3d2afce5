"""The episode journal (rollout/journal.py): an interrupted rollout resumes where it stopped, and ends with the
shards an uninterrupted one writes (`content_sha256`) in-process; after kill -9 of the run, with its episodes
(bitwise but for the server's logprobs: tests/_rollouts.py) and bitwise its weights; and in asynchronous mode."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch

from _rollouts import assert_same_episodes, journal_records, journaled_positions
from areal_pipeline.data.shards import content_sha256, read_manifest, read_table, read_trajectories
from areal_pipeline.data.trajectory import Trajectory
from areal_pipeline.rollout.failures import (EpisodeFailure, EpisodesFailed, FailurePolicy, GroupResult,
                                             RolloutFailureRate)
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
    journal.flush()  # on disk once flushed: another process's journal (a resumed run's) reads them
    loaded = _journal(tmp_path).load(slots)
    assert sorted(loaded) == [0, 2]
    assert loaded[2].trajectories == [] and loaded[2].outcome == "dropped"
    assert loaded[2].failures == [failure] and loaded[2].retried == [failure]
    [segment] = journal.segments()  # one file appended to, not a file per group
    assert [(meta["slot"], rows) for meta, rows in journal_records(segment)] == [(0, 2), (2, 0)]  # dropped: no rows
    got = loaded[0].trajectories
    assert [(t.prompt_id, t.sample_idx, t.input_ids, t.metadata) for t in got] == [
        (t.prompt_id, t.sample_idx, t.input_ids, t.metadata) for t in _group(0).trajectories]
    # what comes back went through the shards' float32 columns
    assert got[0].logprobs[2] == float(torch.tensor(-1 / 3, dtype=torch.float32)) != -1 / 3


def test_the_journal_holds_groups_in_memory_for_its_delay_and_a_short_rollout_writes_none(tmp_path):
    slots = _slots()
    held = EpisodeJournal(tmp_path / "iter_1" / "rollout.episodes", run_id="r", iteration=1, batch_size=4,
                          digest="d1", delay_s=600)
    assert held.load(slots) == {}
    for slot in range(3):
        held.writer(slots)(_group(slot))
    time.sleep(0.3)  # what the writer thread would have written by now without the delay
    assert not held.directory.exists()  # nothing on disk: no header, no segment, no fsync
    held.remove()  # the rollout ended within the delay: what was held is dropped, nothing was ever written
    assert not held.directory.exists()

    held = EpisodeJournal(held.directory, run_id="r", iteration=1, batch_size=4, digest="d1", delay_s=600)
    held.writer(slots)(_group(0))
    held.flush()  # a flush (a discard, a retry's load) writes what is held at once
    held.writer(slots)(_group(1))
    held.close()  # and so does a close
    assert sorted(_journal(tmp_path).load(slots)) == [0, 1]

    delayed = EpisodeJournal(tmp_path / "iter_2" / "rollout.episodes", run_id="r", iteration=2, batch_size=4,
                             digest="d1", delay_s=0.5)
    started = time.monotonic()
    delayed.writer(slots)(_group(2))
    deadline = started + 60
    while not journaled_positions(delayed.directory) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert journaled_positions(delayed.directory) == {2}  # written once the delay passed, with no flush
    assert time.monotonic() - started >= 0.5
    delayed.writer(slots)(_group(3))  # after the delay, groups are written as they end
    while journaled_positions(delayed.directory) != {2, 3} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert journaled_positions(delayed.directory) == {2, 3}
    delayed.close()


def test_many_groups_are_one_file_and_a_later_record_of_a_position_replaces_the_earlier(tmp_path):
    slots, journal = _slots(300), _journal(tmp_path)
    for slot in range(300):
        journal.writer(slots)(_group(slot, outcome="ok"))
    journal.writer(slots)(_group(7, outcome="retried"))
    journal.close()
    later = _journal(tmp_path)  # another opening: a segment of its own, read after the first
    later.writer(slots)(_group(8, outcome="refilled", replaced_prompt_id="p8"))
    later.close()
    assert len(journal.segments()) == 2
    loaded = _journal(tmp_path).load(slots)
    assert sorted(loaded) == list(range(300))
    assert (loaded[7].outcome, loaded[8].outcome, loaded[9].outcome) == ("retried", "refilled", "ok")


def test_a_torn_tail_or_a_foreign_group_is_left_out_named_and_played_again(tmp_path, caplog):
    slots, journal = _slots(), _journal(tmp_path)
    for slot in range(3):
        journal.writer(slots)(_group(slot))
    journal.close()
    [segment] = journal.segments()
    data = segment.read_bytes()
    segment.write_bytes(data[: len(data) - 200])  # a kill in the middle of the last group's append
    assert [meta["slot"] for meta, _ in journal_records(segment)] == [0, 1]
    # the group of another prompt at position 1 (another batch's record), in a later segment
    foreign = _journal(tmp_path)
    foreign.writer({1: {"sampling_seed": 101}})(GroupResult(1, "other", _group(1).trajectories))
    foreign.close()
    foreign_segment = journal.segments()[-1]
    caplog.set_level(logging.WARNING, logger="areal_pipeline")
    loaded = _journal(tmp_path).load(slots)
    assert sorted(loaded) == [0]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(str(segment) in w and "torn" in w for w in warnings), warnings
    assert any(str(foreign_segment) in w and "position 1" in w and "'other'" in w for w in warnings), warnings
    caplog.clear()
    assert sorted(_journal(tmp_path).load(slots)) == [0]  # position 1 was discarded: no second warning about it
    assert not any("'other'" in r.getMessage() for r in caplog.records)


def test_a_bit_flip_in_a_group_is_caught_by_its_digest(tmp_path, caplog):
    slots, journal = _slots(), _journal(tmp_path)
    journal.writer(slots)(GroupResult(0, "p0", [_trajectory("p0", 0, reward=0.25)]))
    journal.close()
    [segment] = journal.segments()
    data = bytearray(segment.read_bytes())
    import struct

    at = bytes(data).index(struct.pack("<f", 0.25))  # the reward's float32, uncompressed in the record
    data[at: at + 4] = struct.pack("<f", 0.75)
    segment.write_bytes(bytes(data))
    caplog.set_level(logging.WARNING, logger="areal_pipeline")
    assert _journal(tmp_path).load(slots) == {}
    assert any(str(segment) in r.getMessage() and "digest" in r.getMessage() for r in caplog.records)


def test_a_writer_that_fails_fails_the_next_write_and_a_load_starts_a_new_segment(tmp_path, monkeypatch, caplog):
    import areal_pipeline.rollout.journal as journal_module

    slots, journal = _slots(), _journal(tmp_path)
    journal.open()
    not_a_file = tmp_path / "iter_1" / "rollout.episodes" / "segment-00001.arrows"
    not_a_file.mkdir()  # the writer cannot open it: as a full disk or a lost mount fails a write
    monkeypatch.setattr(journal_module, "_new_segment", lambda directory: not_a_file)
    with pytest.raises(OSError, match=r"episode journal .*segment-00001.arrows: writing failed: IsADirectory"):
        journal.writer(slots)(_group(0))  # raises here where the writer failed before it was given the group
        journal.flush()
    with pytest.raises(OSError, match="writing failed"):
        journal.writer(slots)(_group(1))
    monkeypatch.undo()
    not_a_file.rmdir()
    caplog.set_level(logging.WARNING, logger="areal_pipeline")
    assert journal.load(slots) == {}  # what it failed to write is played again
    assert any("writing failed" in r.getMessage() and "new segment" in r.getMessage() for r in caplog.records)
    journal.writer(slots)(_group(1))
    assert sorted(journal.load(slots)) == [1]


def test_a_journal_of_other_settings_or_format_is_cleared(tmp_path, caplog):
    base = ["rollout.batch_size=4"]
    digest = episodes_digest(load_config(None, base))
    assert digest == episodes_digest(load_config(None, base))
    assert digest != episodes_digest(load_config(None, [*base, "rollout.gconfig.temperature=0.5"]))
    assert digest != episodes_digest(load_config(None, [*base, "seed=2"]))
    slots = _slots()
    old = _journal(tmp_path, digest)
    old.writer(slots)(_group(0))
    old.close()
    assert sorted(_journal(tmp_path, digest).load(slots)) == [0]
    changed = episodes_digest(load_config(None, [*base, "rollout.gconfig.temperature=0.5"]))
    caplog.set_level(logging.WARNING, logger="areal_pipeline")
    new = _journal(tmp_path, changed)
    assert new.load(slots) == {}
    assert not old.segments() and not (old.directory / "journal.json").exists()  # its header: at its first write
    assert any("other settings (digest)" in r.getMessage() for r in caplog.records)
    new.writer(slots)(_group(1))
    new.close()
    assert json.loads((old.directory / "journal.json").read_text())["digest"] == changed
    # a journal of the first format (a Parquet file per group, no format in its header) is cleared the same way
    header = json.loads((old.directory / "journal.json").read_text())
    del header["format"]
    (old.directory / "journal.json").write_text(json.dumps(header))
    (old.directory / "g-00000.parquet").write_bytes(b"PAR1")
    caplog.clear()
    assert _journal(tmp_path, changed).load(slots) == {}
    assert not (old.directory / "g-00000.parquet").exists()
    assert any("other settings (format)" in r.getMessage() for r in caplog.records)


def test_groups_older_than_the_staleness_bound_are_played_again(tmp_path):
    slots, journal = _slots(), _journal(tmp_path)
    journal.writer(slots)(_group(0, version=1))
    journal.writer(slots)(_group(1, version=2))
    assert sorted(journal.load(slots, oldest_version=2)) == [1]
    assert sorted(_journal(tmp_path).load(slots)) == [1]  # discarded on disk, whatever reads it next


def test_resumed_and_uninterrupted_rollouts_write_the_same_content(tmp_path):
    policy = FailurePolicy()
    groups = [_group(slot) for slot in range(4)]
    straight = finish_rollout(groups, tmp_path / "a" / "rollout", _journal(tmp_path / "a"), policy=policy,
                              seconds=1.0, rows_per_shard=3)
    journal = _journal(tmp_path / "b")
    journal.open()
    for g in groups[:3]:
        journal.writer(_slots())(g)
    loaded = journal.load(_slots())
    resumed = finish_rollout([groups[3], *loaded.values()], tmp_path / "b" / "rollout", journal, policy=policy,
                             seconds=7.0, rows_per_shard=3)
    assert not journal.directory.exists()  # removed once the shards are written
    written = content_sha256(read_table(tmp_path / "a" / "rollout"))
    assert resumed["content_sha256"] == straight["content_sha256"] == written
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
                       seconds=1.0, rows_per_shard=4)
    assert sorted(journal.load(slots)) == [0, 1, 3]
    manifest = finish_rollout(groups, tmp_path / "rollout", journal, policy=FailurePolicy(max_failure_rate=0.5),
                              seconds=1.0, rows_per_shard=4)
    assert manifest["num_rows"] == 6 and manifest["stats"]["groups_dropped"] == 1
    assert manifest["stats"]["failures/reward_crash"] == 2 and manifest["stats"]["failure_rate"] == 0.25
    assert manifest["failures"][0] == {"slot": 2, "prompt_id": "p2", "sample_idx": 0, "cause": "reward_crash",
                                       "peer": "reward worker 3", "attempt": 1, "message": "worker died"}


# ----- the rollout node, with real servers ---------------------------------------------------------------------------
def _pipeline_config(tmp_path: Path, model_dir: Path, *more: str):
    # one group at a time (max_concurrent_rollouts = n_samples), so that a failure lands after some groups ended
    return load_config(None, [f"output_dir={tmp_path}", f"model.path={model_dir}", "total_iterations=2",
                              "rollout.batch_size=4", "rollout.gconfig.n_samples=4",
                              "rollout.max_concurrent_rollouts=4",
                              "rollout.gconfig.max_new_tokens=16", "dataset.arithmetic_train_size=64", *more])


def test_a_retried_rollout_node_plays_only_the_missing_groups(tiny_model_dir, tmp_path, caplog):
    """The node's first attempt fails at its last group (rollout.on_failure=fail): its retry in the same process
    loads the 3 groups on disk (one of them corrupted meanwhile: named, played again) and plays the rest; the shards
    are those of a rollout that ran straight through."""
    from areal_pipeline.pipeline import Pipeline
    from areal_pipeline.run_dir import run_lock

    cfg = _pipeline_config(tmp_path, tiny_model_dir, "rollout.on_failure=fail")
    pipeline = Pipeline(cfg)
    played = []
    caplog.set_level(logging.INFO, logger="areal_pipeline")
    with run_lock(cfg.run_dir):
        try:
            pipeline.start()
            real_episodes = pipeline._episodes
            workflow = pipeline._workflow()

            ids = [r["prompt_id"] for r in real_episodes(1)]
            failing = {ids[3]}  # the last group's episodes lose their tool server on every attempt

            class Counting:  # the workflow, counting the groups it plays
                async def arun_episode(self, engine, data):
                    if data["sample_idx"] == 0:
                        played.append(data["prompt_id"])
                    if data["prompt_id"] in failing:
                        raise ConnectionError("tool server gone")
                    return await workflow.arun_episode(engine, data)
            pipeline._workflow = Counting
            # an episode's failure, which rollout.on_failure=skip would drop: `fail` fails the node with it
            with pytest.raises(EpisodesFailed, match=f"prompt {ids[3]} .*ConnectionError: tool server gone"):
                pipeline.rollout(1)
            failing.clear()
            journal = pipeline.journal(1)
            journal.flush()
            [segment] = journal.segments()
            order = [meta["slot"] for meta, _ in journal_records(segment)]  # as the groups ended
            assert sorted(order) == [0, 1, 2]
            assert not (cfg.run_dir / "iter_1" / "rollout" / "manifest.json").exists()
            journal.close()  # as a killed process leaves it: its last append torn
            segment.write_bytes(segment.read_bytes()[:-100])
            torn = order[-1]
            played.clear()
            resumed = pipeline.rollout(1)  # the retry
            assert played == [ids[slot] for slot in sorted({torn, 3})]  # the torn group and the failed one only
            assert "resuming iteration 1: 2/4 groups on disk" in caplog.text
            assert f"{segment} ends in a torn or unreadable record" in caplog.text
            assert not journal.directory.exists()
            manifest = read_manifest(cfg.run_dir / "iter_1" / "rollout")

            # the same rollout straight through
            (cfg.run_dir / "iter_1" / "rollout" / "manifest.json").unlink()
            played.clear()
            straight = pipeline.rollout(1)
            assert played == ids

            # a journal left beside complete shards (a kill between the manifest and its removal) is removed
            pipeline.journal(1).open()
            pipeline.journal(1).writer(dict(enumerate(pipeline._episodes(1))))(GroupResult(0, ids[0], []))
            assert pipeline.rollout(1)["cached"] is True and not journal.directory.exists()
        finally:
            pipeline.close()
            pipeline.services.stop()
    again = read_manifest(cfg.run_dir / "iter_1" / "rollout")
    assert manifest["content_sha256"] == again["content_sha256"]
    assert resumed["num_trajectories"] == straight["num_trajectories"] == 16
    assert resumed["reward_mean"] == straight["reward_mean"] and resumed["cached"] is straight["cached"] is False


def test_episodes_failing_together_share_one_recovery_of_the_servers(tiny_model_dir, tmp_path):
    """The rollout's `recover` hook after the inference server died: restarted and given the expected version once
    for a burst of failed episodes; a later failure recovers again."""
    import asyncio

    from areal_pipeline.pipeline import Pipeline
    from areal_pipeline.run_dir import run_lock
    from areal_pipeline.utils import run_async

    cfg = _pipeline_config(tmp_path, tiny_model_dir, "eval_freq=0")
    pipeline = Pipeline(cfg)
    calls = []
    with run_lock(cfg.run_dir):
        try:
            pipeline.start()
            pipeline.run_iteration(1)
            pipeline.sync_servers(1)
            server = pipeline.services.inference[0]
            server.popen.kill()
            server.popen.wait(10)
            recover_servers = pipeline.recover_servers
            pipeline.recover_servers = lambda *args: (calls.append(args), recover_servers(*args))[1]
            recover = pipeline.recover_hook(1)

            async def failures():
                await asyncio.gather(*(recover() for _ in range(5)))  # five episodes failed at once
                await recover()  # a later one
            run_async(failures())
            assert calls == [(1, False), (1, False)]
            assert pipeline.services.inference[0].popen.pid != server.popen.pid
            pipeline.services.forget_served()
            assert pipeline.server_versions() == [1]  # the restarted server got version 1 back
        finally:
            pipeline.close()
            pipeline.services.stop()


# ----- kill -9 of the command, rerun --------------------------------------------------------------------------------
def _kill_overrides(tmp_path: Path, model_dir: Path, run_id: str, *more: str) -> list[str]:
    from test_flows import fast_overrides

    # eight groups, one at a time, of long generations (the random tiny model rarely stops early): iteration 2's
    # rollout lasts long enough for the test to see its first groups on disk and kill the command then
    return [*fast_overrides(tmp_path, model_dir, run_id=run_id), "save_freq=1", "rollout.batch_size=8",
            "rollout.max_concurrent_rollouts=4", "rollout.gconfig.max_new_tokens=96",
            "rollout.journal_delay=0", *more]  # its groups on disk as they end, not after the journal's delay


def _kill_when(run, predicate, what: str) -> None:
    from areal_pipeline.forkserver import processes_of
    from test_flows import wait_until

    wait_until(lambda: predicate() or run.poll() is not None, 600, what, interval=0.01)
    assert run.poll() is None, run.stdout.read()
    run.kill()  # SIGKILL: no clean-up code runs
    run.wait()
    wait_until(lambda: processes_of(run.pid) == [], 30, "the killed run's services to exit")


def _groups_on_disk(run_dir: Path, k: int) -> list[int]:
    return sorted(journaled_positions(run_dir / f"iter_{k}" / "rollout.episodes"))


def test_a_killed_rollout_resumes_from_its_journal_to_the_same_weights(prefect_api, tiny_model_dir, tmp_path):
    from test_flows import cli, final_weights

    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    config = ["--config", "configs/tiny_cpu.yaml"]
    reference = cli("train", *config, *_kill_overrides(tmp_path, tiny_model_dir, "ref"), env=env)
    victim_dir = tmp_path / "victim"
    victim = cli("train", *config, *_kill_overrides(tmp_path, tiny_model_dir, "victim"), env=env)
    _kill_when(victim, lambda: len(_groups_on_disk(victim_dir, 2)) >= 2, "2 groups of iteration 2 on disk")
    on_disk = _groups_on_disk(victim_dir, 2)
    assert 2 <= len(on_disk) < 8 and not (victim_dir / "iter_2" / "rollout" / "manifest.json").exists()

    out, _ = reference.communicate(timeout=600)
    assert reference.returncode == 0, out
    rerun = cli("train", *config, *_kill_overrides(tmp_path, tiny_model_dir, "victim"), env=env)
    out, _ = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, out
    log = (victim_dir / "logs" / "train.log").read_text()
    assert f"resuming iteration 2: {len(on_disk)}/8 groups on disk" in log, log[-3000:]
    assert not (victim_dir / "iter_2" / "rollout.episodes").exists()
    assert_same_episodes(victim_dir, tmp_path / "ref", (1, 2, 3))
    a, b = final_weights(tmp_path / "ref", 3), final_weights(victim_dir, 3)
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_a_killed_async_run_keeps_the_groups_it_played_ahead(prefect_api, tiny_model_dir, tmp_path):
    """eta = 1: the command is killed while iteration 3's groups, played ahead during iteration 2, are on disk and
    not yet its shards. The rerun reuses them (playing only the rest), and the run trains every prompt of every
    iteration exactly once (the batch shards against `select_batch`), within the staleness bound."""
    from collections import Counter

    from areal_pipeline.pipeline import Pipeline
    from test_flows import cli

    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    overrides = _kill_overrides(tmp_path, tiny_model_dir, "async", "rollout.max_head_offpolicyness=1")
    run_dir = tmp_path / "async"
    victim = cli("train", "--config", "configs/tiny_cpu.yaml", *overrides, env=env)
    _kill_when(victim, lambda: len(_groups_on_disk(run_dir, 3)) >= 2, "2 groups of iteration 3 on disk")
    on_disk = _groups_on_disk(run_dir, 3)
    assert len(on_disk) < 8 and not (run_dir / "iter_3" / "rollout" / "manifest.json").exists()

    rerun = cli("train", "--config", "configs/tiny_cpu.yaml", *overrides, env=env)
    out, _ = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, out
    log = (run_dir / "logs" / "train.log").read_text()
    assert f"resuming iteration 3: {len(on_disk)}/8 groups on disk" in log, log[-3000:]

    cfg = load_config(REPO / "configs" / "tiny_cpu.yaml", overrides)
    pipeline = Pipeline(cfg)
    for k in (1, 2, 3):
        trained = Counter(zip(*read_table(run_dir / f"iter_{k}" / "batch", schema=None).select(
            ["prompt_id", "sample_idx"]).to_pydict().values()))
        expected = Counter((r["prompt_id"], i) for r in pipeline._episodes(k) for i in range(4))
        assert trained == expected, k  # no prompt skipped, none trained twice
        assert not (run_dir / f"iter_{k}" / "rollout.episodes").exists()
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in metrics] == [1, 2, 3]
    assert all(0 <= m["staleness"] <= 1 for m in metrics), metrics


REPO = Path(__file__).resolve().parents[1]


def test_an_async_failure_keeps_every_iteration_s_finished_groups(tmp_path, caplog):
    """eta = 1: iteration 1 fails at its last group while iteration 2 was played ahead. A new executor (the node's
    retry) plays iteration 1's failed group only, and iteration 2 not at all."""
    import asyncio
    import contextlib

    from areal_pipeline.rollout.async_executor import AsyncRolloutExecutor

    played = []

    class Workflow:
        def __init__(self, fail: bool):
            self.fail = fail

        async def arun_episode(self, engine, data):
            played.append((data["k"], data["n"]))
            if self.fail and (data["k"], data["n"]) == (1, 3):
                await asyncio.sleep(0.3)  # iteration 2's groups end first
                raise ConnectionError("tool server gone")
            return _trajectory(data["prompt_id"], data["sample_idx"])

    @contextlib.asynccontextmanager
    async def no_engine():
        yield None

    def executor(fail: bool) -> AsyncRolloutExecutor:
        return AsyncRolloutExecutor(
            first_iteration=1, last_iteration=2, eta=1, version=0, workflow=Workflow(fail), engine_factory=no_engine,
            batch_for=lambda k: [{"prompt_id": f"p{k}-{n}", "sampling_seed": n, "k": k, "n": n} for n in range(4)],
            max_concurrent_rollouts=16, n_samples=1, policy=FailurePolicy(episode_retries=0, on_failure="fail"),
            journal_for=lambda k: EpisodeJournal(tmp_path / f"iter_{k}" / "rollout.episodes", run_id="r",
                                                 iteration=k, batch_size=4, digest="d"))
    first = executor(fail=True)
    first.start()
    try:
        with pytest.raises(EpisodesFailed, match="ConnectionError: tool server gone"):
            first.collect(1, timeout=30)
        assert [g.slot for g in first.collect(2, timeout=30)] == [0, 1, 2, 3]
    finally:
        first.stop()
    played.clear()
    caplog.set_level(logging.INFO, logger="areal_pipeline")
    retry = executor(fail=False)
    retry.start()
    try:
        groups = {k: retry.collect(k, timeout=30) for k in (1, 2)}
    finally:
        retry.stop()
    assert played == [(1, 3)]
    assert [g.prompt_id for g in groups[1]] == [f"p1-{n}" for n in range(4)]
    assert [g.prompt_id for g in groups[2]] == [f"p2-{n}" for n in range(4)]
    # the synchronous rollout's resume, written once (executor.resume_batch)
    assert "resuming iteration 1: 3/4 groups on disk" in caplog.text
    assert "resuming iteration 2: 4/4 groups on disk" in caplog.text
