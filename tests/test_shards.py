import json

import numpy as np
import pytest

from areal_pipeline.data import shards
from areal_pipeline.data.shards import (
    TRAJECTORY_SCHEMA,
    CorruptShardError,
    ShardError,
    is_complete,
    part_files,
    read_manifest,
    read_table,
    read_trajectories,
    verify_shards,
    write_shards,
)
from areal_pipeline.data.trajectory import NO_VERSION, Trajectory


def _trajectories(n: int) -> list[Trajectory]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        prompt_len, gen_len = 3 + i % 4, 2 + i % 3
        out.append(
            Trajectory(
                prompt_id=f"p{i // 4}",
                group_id=f"g{i // 4}",
                sample_idx=i % 4,
                input_ids=rng.integers(0, 50_000, prompt_len + gen_len).tolist(),
                loss_mask=[0] * prompt_len + [1] * gen_len,
                # float32 values: what the shard stores is then exactly what was written
                logprobs=[0.0] * prompt_len + rng.normal(-1, 0.5, gen_len).astype(np.float32).tolist(),
                versions=[NO_VERSION] * prompt_len + [i % 3] * gen_len,
                reward=float(np.float32(rng.random())),
                num_turns=1 + i % 2,
                stop_reason="stop" if i % 2 else "length",
                messages=[{"role": "user", "content": f"q{i} é"}, {"role": "assistant", "content": "42"}],
                text=f"q{i} é 42",
                metadata={"answer": "42", "correct": bool(i % 2), "scores": [0.5, 1.0]},
            )
        )
    return out


def test_round_trip(tmp_path):
    trajs = _trajectories(10)
    manifest = write_shards(trajs, tmp_path, run_id="r", iteration=3, extra_manifest={"stage": "rollout"})
    assert is_complete(tmp_path)
    assert read_trajectories(tmp_path) == trajs
    table = read_table(tmp_path)
    assert table.schema == TRAJECTORY_SCHEMA
    assert table.column("run_id").to_pylist() == ["r"] * 10
    assert table.column("iteration").to_pylist() == [3] * 10
    assert json.loads(table.column("metadata")[1].as_py()) == trajs[1].metadata
    assert manifest == read_manifest(tmp_path)
    assert (manifest["run_id"], manifest["iteration"], manifest["num_rows"]) == ("r", 3, 10)
    assert manifest["stage"] == "rollout"


def test_multi_shard_split(tmp_path):
    trajs = _trajectories(10)
    manifest = write_shards(trajs, tmp_path, run_id="r", iteration=0, rows_per_shard=4)
    assert [s["file"] for s in manifest["shards"]] == [f"part-{k:05d}.parquet" for k in range(3)]
    assert [s["rows"] for s in manifest["shards"]] == [4, 4, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"] + [s["file"] for s in manifest["shards"]]
    assert read_trajectories(tmp_path) == trajs


def test_empty_output_keeps_schema(tmp_path):
    manifest = write_shards([], tmp_path, run_id="r", iteration=0)
    assert manifest["num_rows"] == 0 and len(manifest["shards"]) == 1
    assert read_table(tmp_path).schema == TRAJECTORY_SCHEMA
    assert read_trajectories(tmp_path) == []


def test_checksums_detect_corruption(tmp_path):
    manifest = write_shards(_trajectories(6), tmp_path, run_id="r", iteration=0, rows_per_shard=3)
    verify_shards(tmp_path)
    victim = tmp_path / manifest["shards"][1]["file"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert is_complete(tmp_path)  # same size: only hashing can tell
    with pytest.raises(ShardError, match="part-00001.parquet: sha256"):
        verify_shards(tmp_path)
    with pytest.raises(CorruptShardError, match="part-00001.parquet: sha256 mismatch"):
        read_trajectories(tmp_path)  # every read checks
    victim.write_bytes(bytes(data[:-10]))
    assert not is_complete(tmp_path)
    size = f"size {len(data) - 10} != manifest {len(data)}"
    with pytest.raises(CorruptShardError, match=f"part-00001.parquet: {size}"):
        read_table(tmp_path)


def test_overwrite_protection(tmp_path):
    write_shards(_trajectories(6), tmp_path, run_id="r", iteration=0, rows_per_shard=2)
    with pytest.raises(ShardError, match="overwrite=True"):
        write_shards(_trajectories(2), tmp_path, run_id="r", iteration=0)
    manifest = write_shards(_trajectories(2), tmp_path, run_id="r", iteration=0, overwrite=True)
    assert [s["file"] for s in manifest["shards"]] == ["part-00000.parquet"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "part-00000.parquet"]
    assert len(read_trajectories(tmp_path)) == 2
    with pytest.raises(ValueError, match="num_rows"):
        write_shards([], tmp_path / "x", run_id="r", iteration=0, extra_manifest={"num_rows": 1})


def test_crash_mid_write_leaves_no_result(tmp_path, monkeypatch):
    real_write = shards.pq.write_table
    calls = []

    def crashing_write(table, where, **kw):
        calls.append(1)
        if len(calls) > 1:
            raise OSError("disk full")
        real_write(table, where, **kw)

    monkeypatch.setattr(shards.pq, "write_table", crashing_write)
    with pytest.raises(OSError, match="disk full"):
        write_shards(_trajectories(6), tmp_path, run_id="r", iteration=0, rows_per_shard=2)
    assert [p.name for p in tmp_path.iterdir()] == ["part-00000.parquet"]
    assert not is_complete(tmp_path)
    with pytest.raises(ShardError, match="incomplete"):
        read_trajectories(tmp_path)

    # A killed writer's hidden temp file is ignored by readers and cleared by the retry.
    (tmp_path / ".part-00001.parquet.tmp-1-abcdef01").write_bytes(b"PAR1 half")
    monkeypatch.setattr(shards.pq, "write_table", real_write)
    write_shards(_trajectories(6), tmp_path, run_id="r", iteration=0, rows_per_shard=2)
    assert is_complete(tmp_path)
    assert not list(tmp_path.glob(".*"))


def test_readable_by_pandas_duckdb_and_datasets(tmp_path):
    import duckdb
    import pandas as pd
    from datasets import load_dataset

    trajs = _trajectories(7)
    write_shards(trajs, tmp_path, run_id="r", iteration=1, rows_per_shard=3)
    (tmp_path / ".part-00009.parquet.tmp-1-abcdef01").write_bytes(b"not parquet")

    df = pd.read_parquet(part_files(tmp_path))
    assert len(df) == 7
    assert df["prompt_id"].tolist() == [t.prompt_id for t in trajs]
    assert df["input_ids"].iloc[2].tolist() == trajs[2].input_ids
    assert json.loads(df["messages"].iloc[0]) == trajs[0].messages

    rows = duckdb.sql(
        f"select sample_idx, reward, len(input_ids) from '{tmp_path}/part-*.parquet' order by prompt_id, sample_idx"
    ).fetchall()
    assert len(rows) == 7
    assert rows[0] == (trajs[0].sample_idx, pytest.approx(trajs[0].reward), len(trajs[0].input_ids))

    ds = load_dataset("parquet", data_files=part_files(tmp_path), split="train", cache_dir=str(tmp_path / ".hf"))
    assert ds.num_rows == 7
    assert ds[6]["logprobs"] == pytest.approx(trajs[6].logprobs)
    assert json.loads(ds[4]["metadata"]) == trajs[4].metadata


def test_the_rollout_manifest_s_stats_are_those_of_its_shards_read_back(tmp_path):
    """finish_rollout computes the stats from the trajectories it was given, with their rewards as the shards store
    them (float32: `with_stored_rewards`), not from the table read back: the figures must be the same a reader of
    the shards computes, here for rewards and baselines float32 cannot hold exactly (0.1, 1/3)."""
    from areal_pipeline.rollout.executor import rollout_stats
    from areal_pipeline.rollout.failures import FailurePolicy, GroupResult
    from areal_pipeline.rollout.journal import EpisodeJournal, finish_rollout

    trajectories = _trajectories(8)
    for i, t in enumerate(trajectories):
        t.reward = [0.1, 1 / 3, 0.7, -0.2][i % 4]
        t.baseline_reward = 1 / 7 if i % 2 else None
        t.metadata["num_searches"] = i % 3
    assert rollout_stats(trajectories, 2.0)["reward_mean"] != rollout_stats(
        read_trajectories(_written(trajectories, tmp_path / "plain")), 2.0)["reward_mean"]  # float32 shows
    groups = [GroupResult(slot, f"p{slot}", trajectories[4 * slot:4 * slot + 4], episodes=4) for slot in range(2)]
    journal = EpisodeJournal(tmp_path / "rollout.episodes", run_id="r", iteration=1, batch_size=2, digest="d")
    manifest = finish_rollout(groups, tmp_path / "rollout", journal, policy=FailurePolicy(max_failure_rate=1.0),
                              seconds=2.0, rows_per_shard=3)
    assert manifest["stats"] == rollout_stats(read_trajectories(tmp_path / "rollout"), 2.0, groups)
    assert manifest["stats"]["agent/num_searches"] == 7 / 8 and "baseline_reward" in manifest["stats"]


def _written(trajectories, out):
    write_shards(trajectories, out, run_id="r", iteration=1)
    return out
