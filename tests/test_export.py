"""`areal-pipeline export`: SFT and preference data sets from a run's real rollout shards (written by the shard
writer the rollout uses), opened with `datasets.load_dataset`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from areal_pipeline.data.export import ExportError, export_dataset, parse_iteration_range
from areal_pipeline.data.shards import CorruptShardError, write_shards
from areal_pipeline.data.trajectory import Trajectory

REPO = Path(__file__).resolve().parents[1]


def _trajectory(prompt: str, answer: str, reward: float, sample_idx: int, turns: int = 1) -> Trajectory:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": prompt}]
    for turn in range(turns):
        if turn:
            messages.append({"role": "user", "content": "Your answer is wrong. Try again."})
        messages.append({"role": "assistant", "content": f"{answer}{'!' * turn}"})
    ids = list(range(4 + turns))
    return Trajectory(prompt_id=prompt, group_id=prompt, sample_idx=sample_idx, input_ids=ids,
                      loss_mask=[0] * 2 + [1] * (len(ids) - 2), logprobs=[0.0] * len(ids),
                      versions=[0] * len(ids), reward=reward, num_turns=turns, messages=messages,
                      text=answer, metadata={"answer": answer})


def _write_run(run_dir: Path) -> None:
    """Two iterations: "1+1" answered right twice (the same answer: a duplicate for SFT) and wrong twice;
    "2+2" only wrong (no pair); iteration 2 has a two-turn episode and a second right answer of "1+1" (the
    same conversation as iteration 1's, so SFT keeps it once); iteration 3 never finished (no manifest)."""
    iteration_1 = [_trajectory("1+1", "2", 1.0, 0), _trajectory("1+1", "3", 0.0, 1),
                   _trajectory("1+1", "2", 1.0, 2), _trajectory("1+1", "11", 0.0, 3),
                   _trajectory("2+2", "5", 0.0, 0), _trajectory("2+2", "22", 0.0, 1)]
    iteration_2 = [_trajectory("1+1", "2", 1.0, 0), _trajectory("1+1", "7", 0.0, 1),
                   _trajectory("3+3", "6", 0.9, 0, turns=2), _trajectory("3+3", "9", 0.0, 1, turns=2)]
    write_shards(iteration_1, run_dir / "iter_1" / "rollout", run_id="r", iteration=1, rows_per_shard=4)
    write_shards(iteration_2, run_dir / "iter_2" / "rollout", run_id="r", iteration=2)
    unfinished = run_dir / "iter_3" / "rollout"
    write_shards(iteration_2, unfinished, run_id="r", iteration=3)
    (unfinished / "manifest.json").unlink()


@pytest.fixture
def run_dir(tmp_path) -> Path:
    _write_run(tmp_path / "r")
    return tmp_path / "r"


def _load(path: Path):
    from datasets import load_dataset

    kind = "parquet" if path.suffix == ".parquet" else "json"
    return load_dataset(kind, data_files=str(path), split="train", cache_dir=str(path.parent / ".hf-cache"))


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_sft_keeps_accepted_conversations_once(run_dir, tmp_path, suffix):
    out = tmp_path / f"sft{suffix}"
    result = export_dataset(run_dir, out, "sft", min_reward=1.0)
    assert result.rows == 1 and result.trajectories == 10 and result.iterations == (1, 2)
    assert result.skipped_unfinished == [3]
    data = _load(out)
    assert data.num_rows == 1
    row = data[0]
    assert row["messages"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1"},
                               {"role": "assistant", "content": "2"}]
    assert (row["iteration"], row["prompt_id"], row["sample_idx"], row["reward"]) == (1, "1+1", 0, 1.0)

    everything = export_dataset(run_dir, tmp_path / f"all{suffix}", "sft", min_reward=0.5, keep_duplicates=True)
    assert everything.rows == 4  # 1+1 x3 (duplicates kept) and the two-turn 3+3
    two_turn = [r for r in _load(tmp_path / f"all{suffix}") if r["prompt_id"] == "3+3"]
    assert [m["role"] for m in two_turn[0]["messages"]] == ["system", "user", "assistant", "user", "assistant"]


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_preference_pairs_best_with_worst_within_a_group(run_dir, tmp_path, suffix):
    out = tmp_path / f"pref{suffix}"
    result = export_dataset(run_dir, out, "preference", min_reward=0.5)
    pairs = sorted(_load(out), key=lambda r: (r["iteration"], r["prompt_id"], r["chosen_sample"]))
    assert result.rows == len(pairs) == 4
    # iteration 1, "1+1": accepted samples 0 and 2, rejected 1 and 3: two pairs, no sample used twice; "2+2" has
    # nothing accepted, so no pair
    first, second = pairs[0], pairs[1]
    assert (first["chosen_sample"], first["rejected_sample"]) == (0, 1)
    assert (second["chosen_sample"], second["rejected_sample"]) == (2, 3)
    assert first["prompt"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1"}]
    assert first["chosen"] == [{"role": "assistant", "content": "2"}]
    assert first["rejected"] == [{"role": "assistant", "content": "3"}]
    assert (first["score_chosen"], first["score_rejected"]) == (1.0, 0.0)
    # the two-turn episode: the prompt ends before the first model turn, the rest of the episode is the answer
    (multi,) = [p for p in pairs if p["prompt_id"] == "3+3"]
    assert len(multi["prompt"]) == 2 and [m["role"] for m in multi["chosen"]] == ["assistant", "user", "assistant"]
    assert multi["rejected"][0]["content"] == "9"


def test_iteration_range_and_bad_input(run_dir, tmp_path):
    only_2 = export_dataset(run_dir, tmp_path / "two.jsonl", "sft", min_reward=0.5, first=2, last=2)
    assert only_2.rows == 2 and only_2.iterations == (2, 2) and only_2.skipped_unfinished == []
    assert parse_iteration_range("5") == (5, 5) and parse_iteration_range("5:") == (5, None)
    assert parse_iteration_range(":7") == (None, 7) and parse_iteration_range("2:3") == (2, 3)
    for text in ("", ":", "a:b", "0:3", "1-3"):
        with pytest.raises(ExportError):
            parse_iteration_range(text)

    out = tmp_path / "none.parquet"
    with pytest.raises(ExportError, match="nothing to export: .* reward >= 2 .*best reward 1"):
        export_dataset(run_dir, out, "sft", min_reward=2)
    assert not out.exists() and not list(tmp_path.glob(".none.parquet.tmp-*"))  # no partial file left
    with pytest.raises(ExportError, match="must end in"):
        export_dataset(run_dir, tmp_path / "x.csv", "sft")
    with pytest.raises(ExportError, match="unknown format"):
        export_dataset(run_dir, tmp_path / "x.jsonl", "dpo")
    with pytest.raises(ExportError, match="finite"):
        export_dataset(run_dir, tmp_path / "x.jsonl", "sft", min_reward=float("nan"))
    with pytest.raises(ExportError, match="no run directory"):
        export_dataset(tmp_path / "missing", tmp_path / "x.jsonl")
    with pytest.raises(ExportError, match="no finished rollout shards in iterations 3"):
        export_dataset(run_dir, tmp_path / "x.jsonl", first=3)

    # a shard whose bytes changed is named, and nothing is written
    shard = run_dir / "iter_1" / "rollout" / "part-00001.parquet"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match="part-00001.parquet"):
        export_dataset(run_dir, tmp_path / "corrupt.jsonl")
    assert not (tmp_path / "corrupt.jsonl").exists()


def test_the_command_line(run_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = tmp_path / "cli.parquet"
    done = subprocess.run([sys.executable, "-m", "cli", "export", "--run-id", "r",
                           "--output-dir", str(tmp_path), "--format", "preference", "--min-reward", "1",
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"wrote 3 preference pairs to {out}" in done.stdout
    assert "prefect" not in done.stderr.lower()

    bad = subprocess.run([sys.executable, "-m", "cli", "export", "--run-id", "nope",
                          "--output-dir", str(tmp_path), "--out", str(tmp_path / "x.jsonl")], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0
    assert bad.stderr.strip().splitlines()[-1] == f"export error: no run directory {tmp_path / 'nope'}"
