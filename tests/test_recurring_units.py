"""The parts of a recurring line that need no server: the gate's paired tests against hand-computed values, the
ledger (atomic, checksummed, one champion), the data window (new files, changed files, the gate's prompts, replay)
and which checkpoints a run prunes."""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from areal_pipeline.recurring import gate
from areal_pipeline.recurring.incoming import (DataChangedError, check_dataset_reads_rows, data_files, gate_rows,
                                               iterations_for, rows_digest, take_window, write_rows)
from areal_pipeline.recurring.ledger import Ledger, LedgerError, LineBusyError, line_lock


# ----- the gate -------------------------------------------------------------------------------------------------

def test_mcnemar_exact_one_sided_p_values_by_hand():
    # b = 8 prompts only the candidate passes, c = 1 only the champion: P(X >= 8), X ~ Bin(9, 1/2) = (9 + 1) / 512
    assert gate.mcnemar_p_value(8, 1) == pytest.approx(10 / 512)
    assert gate.mcnemar_p_value(3, 0) == pytest.approx(1 / 8)  # all three discordant pairs: (1/2)^3
    assert gate.mcnemar_p_value(0, 4) == 1.0  # P(X >= 0)
    assert gate.mcnemar_p_value(2, 2) == pytest.approx(11 / 16)  # (6 + 4 + 1) / 16
    assert gate.mcnemar_p_value(0, 0) == 1.0  # no prompt tells them apart
    assert gate.mcnemar_p_value(1, 0) == 0.5  # one discordant pair


def test_a_policy_s_summary_is_its_mean_reward_and_the_share_it_solves():
    assert gate.summary({"a": 1.0, "b": 0.5, "c": 0.0}) == {"prompts": 3, "mean_reward": 0.5, "pass_at_1": 1 / 3}
    assert gate.summary({"a": 0.5}) == {"prompts": 1, "mean_reward": 0.5, "pass_at_1": 0.0}
    assert gate.summary({}) == {"prompts": 0, "mean_reward": 0.0, "pass_at_1": 0.0}


def test_the_mcnemar_gate_counts_discordant_prompts_and_decides():
    champion = {f"p{i}": 0.0 for i in range(10)} | {"p0": 1.0}
    candidate = {f"p{i}": 1.0 for i in range(10)} | {"p0": 0.0, "p9": 0.0}
    # only the candidate passes p1..p8 (b = 8), only the champion p0 (c = 1), neither p9
    record = gate.decide(champion, candidate, test="mcnemar", min_improvement=0.0, confidence=0.95)
    assert (record["only_candidate"], record["only_champion"]) == (8, 1)
    assert record["improvement"] == pytest.approx(0.7)  # (8 - 1) / 10
    assert record["p_value"] == pytest.approx(10 / 512)
    assert record["passed"] and record["champion"]["pass_at_1"] == 0.1 and record["candidate"]["pass_at_1"] == 0.8
    # the same pairs against a bar of 0.8 improvement: not enough
    stricter = gate.decide(champion, candidate, test="mcnemar", min_improvement=0.8, confidence=0.95)
    assert not stricter["passed"] and "below 0.8" in stricter["reason"]
    # and at 99% confidence: significant at 2%, not at 1%
    assert not gate.decide(champion, candidate, test="mcnemar", min_improvement=0.0, confidence=0.99)["passed"]


def test_bootstrap_p_value_against_an_exact_enumeration():
    """Three prompts, differences (1, 0, 0): the bootstrap resamples 3 of 3 with replacement, whose mean is <= 0
    exactly when no draw is the first prompt: (2/3)^3 = 8/27. Many resamples converge on it."""
    p = gate.bootstrap_p_value([1.0, 0.0, 0.0], min_improvement=0.0, resamples=200_000, seed=3)
    assert p == pytest.approx(8 / 27, abs=0.005)
    # every difference above the bar: only the observed set counts, p = 1 / (B + 1)
    assert gate.bootstrap_p_value([0.5, 0.25, 1.0], 0.0, 999, seed=1) == pytest.approx(1 / 1000)
    # every difference at or below the bar: p = 1
    assert gate.bootstrap_p_value([0.0, -1.0, 0.0], 0.0, 999, seed=1) == 1.0
    # resamples drawn in chunks: 1500 is 1500 draws, not two chunks of a thousand
    assert gate.bootstrap_p_value([0.0, -1.0, 0.0], 0.0, 1500, seed=1) == 1.0
    assert gate.bootstrap_p_value([0.5, 0.25, 1.0], 0.0, 1500, seed=1) == pytest.approx(1 / 1501)


def test_bootstrap_is_seeded_and_its_lower_bound_brackets_the_mean():
    rng = random.Random(0)
    differences = [rng.choice([1.0, 0.0, 0.0, -1.0, 1.0]) for _ in range(60)]
    first = gate.bootstrap_p_value(differences, 0.0, 5000, seed=7)
    assert gate.bootstrap_p_value(differences, 0.0, 5000, seed=7) == first  # a rerun decides the same
    mean = sum(differences) / len(differences)
    lower = gate.bootstrap_lower_bound(differences, 0.95, 5000, seed=7)
    se = math.sqrt(sum((d - mean) ** 2 for d in differences) / (len(differences) - 1) / len(differences))
    assert lower < mean and lower == pytest.approx(mean - 1.645 * se, abs=0.05)  # the normal approximation


def test_the_bootstrap_gate_rejects_a_tie_and_a_regression_and_passes_a_clear_gain():
    champion = {f"p{i}": float(i % 2) for i in range(20)}
    tie = gate.decide(champion, dict(champion), test="bootstrap", min_improvement=0.0, confidence=0.95)
    assert tie["improvement"] == 0 and tie["p_value"] == 1.0 and not tie["passed"]
    worse = gate.decide(champion, {p: 0.0 for p in champion}, test="bootstrap", min_improvement=0.0, confidence=0.95)
    assert worse["improvement"] == -0.5 and not worse["passed"] and "below" in worse["reason"]
    better = gate.decide(champion, {p: 1.0 for p in champion}, test="bootstrap", min_improvement=0.2,
                         confidence=0.95)
    # differences: ten 1s, ten 0s; a resample's mean is <= 0.2 when at most 4 of its 20 draws are 1s:
    # P(Bin(20, 1/2) <= 4) = (1 + 20 + 190 + 1140 + 4845) / 2^20
    assert better["improvement"] == 0.5 and better["passed"]
    assert better["p_value"] == pytest.approx(6196 / 2 ** 20, abs=0.002)


def test_the_gate_refuses_policies_scored_on_other_prompts():
    with pytest.raises(gate.GateError, match="same prompts"):
        gate.decide({"a": 1.0}, {"b": 1.0}, test="bootstrap", min_improvement=0, confidence=0.9)


# ----- the ledger -----------------------------------------------------------------------------------------------

def test_the_ledger_round_trips_and_refuses_an_edited_file(tmp_path):
    path = tmp_path / "ledger.json"
    ledger = Ledger.new(path, "l", "/models/base")
    firing = ledger.start_firing("firing", "run-1")
    ledger.consume(firing, [{"name": "a.jsonl", "sha256": "x", "rows": 3}])
    ledger.crown({"firing": 1, "run_id": "l-0001", "iteration": 4, "checkpoint": "c", "model": "c/model"})
    ledger.end_firing(firing, "promoted")
    ledger.save()
    again = Ledger.load(path)
    assert again.champion["run_id"] == "l-0001" and again.watermark["a.jsonl"]["firing"] == 1
    assert again.open_firing is None and again.next_id == 2
    data = json.loads(path.read_text())
    data["champion"]["run_id"] = "someone-else"
    path.write_text(json.dumps(data))
    with pytest.raises(LedgerError, match="does not match its checksum"):
        Ledger.load(path)
    path.write_text('{"format": 1, "line"')  # cut short
    with pytest.raises(LedgerError, match="not a readable ledger"):
        Ledger.load(path)


def test_a_firing_starts_empty_from_the_champion_and_a_resume_adds_its_flow_run_once(tmp_path):
    ledger = Ledger.new(tmp_path / "ledger.json", "l", "/models/base")
    first = ledger.start_firing("firing", None)
    assert (first["id"], first["state"], first["rows"], first["replay_rows"], first["from"]) == (1, "running", 0, 0,
                                                                                                 None)
    assert first["flow_runs"] == []
    ledger.crown({"firing": 1, "run_id": "l-0001", "iteration": 4, "checkpoint": "c", "model": "c/model"})
    ledger.end_firing(first, "promoted")
    second = ledger.start_firing("firing", "run-2", ["seed=3"])
    assert second["from"] == {"run_id": "l-0001", "iteration": 4} and second["overrides"] == ["seed=3"]
    ledger.fail_firing(second, "killed")
    ledger.resume_firing(second, "run-3")
    ledger.resume_firing(second, "run-3")  # the same flow run resumed again: listed once
    assert second["flow_runs"] == ["run-2", "run-3"] and (second["state"], second["error"]) == ("running", None)


def test_a_rollback_to_the_base_model_is_recorded_as_iteration_0(tmp_path):
    ledger = Ledger.new(tmp_path / "ledger.json", "l", "/models/base")
    ledger.crown(None)
    assert ledger.champion is None
    assert {k: v for k, v in ledger.data["champions"][-1].items() if k != "since"} == {
        "run_id": None, "iteration": 0, "firing": None}


def test_the_gate_s_rows_come_from_a_file_and_an_empty_file_is_refused(tmp_path):
    from areal_pipeline.data.datasets import DatasetError
    from areal_pipeline.run_spec import load_config

    gate_file = tmp_path / "gate.jsonl"
    (tmp_path / "data").mkdir()
    write_rows(gate_file, [{"question": "What is 2+2?", "answer": "4"}, {"id": "g7", "question": "1+1?", "answer": "2"}])
    cfg = load_config(None, [f"recurring.gate_split={gate_file}", f"dataset.path={tmp_path / 'data'}",
                             f"output_dir={tmp_path}"])
    assert [r["id"] for r in gate_rows(cfg)] == ["gate:0", "gate:g7"]
    gate_file.write_text("")
    with pytest.raises(DatasetError, match="no rows"):
        gate_rows(cfg)


def test_a_line_needs_files_of_rows_and_trains_one_pass_unless_told():
    from areal_pipeline.config.schema import DatasetConfig

    assert "generates its puzzles" in check_dataset_reads_rows(DatasetConfig(name="grid", path="/data"))
    assert "dataset.path: empty" in check_dataset_reads_rows(DatasetConfig(name="arithmetic", path=""))
    assert check_dataset_reads_rows(DatasetConfig(name="arithmetic", path="/data")) is None
    assert iterations_for(rows=33, batch_size=16, configured=0) == 3 and iterations_for(0, 16, 0) == 1
    assert iterations_for(rows=33, batch_size=16, configured=5) == 5


def test_the_line_lock_makes_the_line_s_directory(tmp_path):
    with line_lock(tmp_path / "lines" / "new-line", timeout=1):
        assert (tmp_path / "lines" / "new-line" / ".lock").is_file()


def test_each_save_keeps_the_previous_version_and_replaces_the_file_whole(tmp_path):
    path = tmp_path / "ledger.json"
    ledger = Ledger.new(path, "l", "base")
    ledger.save()
    first = path.read_text()
    ledger.start_firing("firing", None)
    ledger.save()
    assert (tmp_path / "ledger.prev.json").read_text() == first
    assert Ledger.load(tmp_path / "ledger.prev.json").firings == []  # the previous version still verifies
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ledger.json", "ledger.prev.json"]  # no temp file left


KILLER = textwrap.dedent("""
    import os, signal, sys
    from areal_pipeline.recurring.ledger import Ledger
    path, n = sys.argv[1], int(sys.argv[2])
    ledger = Ledger.load(path) or Ledger.new(path, "l", "base")
    for i in range(n):
        firing = ledger.start_firing("firing", None)
        ledger.crown({"firing": firing["id"], "run_id": f"l-{firing['id']}", "iteration": firing["id"],
                      "checkpoint": "c", "model": "m"})
        ledger.end_firing(firing, "promoted")
        ledger.save()
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_ledger_killed_while_it_writes_is_never_half_written(tmp_path):
    """kill -9 at arbitrary points of many saves (a process that writes as fast as it can, killed by a timer):
    what is on disk always loads, verifies, and names exactly one champion, that of its last firing."""
    path = tmp_path / "ledger.json"
    for attempt in range(8):
        writer = subprocess.Popen([sys.executable, "-c", KILLER, str(path), "100000"], cwd=tmp_path)
        try:
            writer.wait(timeout=0.4 + 0.15 * attempt)
        except subprocess.TimeoutExpired:
            writer.kill()
            writer.wait()
        ledger = Ledger.load(path)
        if ledger is None:
            continue  # killed before its first save
        assert ledger.champion["firing"] == ledger.firings[-1]["id"] == ledger.next_id - 1
        assert [f["id"] for f in ledger.firings] == list(range(1, ledger.next_id))
    assert Ledger.load(path) is not None and Ledger.load(path).next_id > 1


def test_the_line_lock_waits_then_names_its_holder(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pathlib import Path
        from areal_pipeline.recurring.ledger import line_lock
        with line_lock(Path({str(tmp_path)!r}), 5):
            print("held", flush=True)
            time.sleep(30)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        waited = []
        with pytest.raises(LineBusyError, match=rf"busy \(pid {holder.pid} since"):
            with line_lock(tmp_path, 1.0, on_wait=waited.append, poll_s=0.1):
                pass
        assert waited and f"pid {holder.pid}" in waited[0]
        holder.kill()  # a killed holder's lock is free at once
        holder.wait()
        with line_lock(tmp_path, 5.0):
            pass
    finally:
        holder.kill()


# ----- the data window ------------------------------------------------------------------------------------------

def _rows(n: int, start: int = 0) -> list[dict]:
    return [{"question": f"What is {i}+1?", "answer": str(i + 1)} for i in range(start, start + n)]


def _consume(watermark: dict, window, firing: int) -> None:
    for f in window.files:
        watermark[f.name] = {"sha256": f.sha256, "rows": f.rows, "firing": firing}


def test_a_window_takes_new_files_whole_and_leaves_unfinished_ones(tmp_path):
    write_rows(tmp_path / "day-1.jsonl", _rows(5))
    write_rows(tmp_path / "day-2.jsonl", _rows(3, 100))
    (tmp_path / ".day-3.jsonl.tmp").write_text(json.dumps(_rows(1)[0]) + "\n")  # being written
    (tmp_path / "day-4.jsonl.part").write_text(json.dumps(_rows(1)[0]) + "\n")
    (tmp_path / "notes.txt").write_text("not data\n")
    assert [p.name for p in data_files(tmp_path)] == ["day-1.jsonl", "day-2.jsonl"]
    watermark: dict = {}
    window = take_window(tmp_path, watermark, set(), max_rows=0, replay_fraction=0.0, seed=1)
    assert [f.name for f in window.files] == ["day-1.jsonl", "day-2.jsonl"] and len(window.rows) == 8
    assert window.rows[0]["id"] == "day-1.jsonl:0" and window.rows[5]["id"] == "day-2.jsonl:0"
    _consume(watermark, window, 1)
    assert take_window(tmp_path, watermark, set(), max_rows=0, replay_fraction=0.0, seed=2).rows == []  # no new


def test_max_rows_takes_whole_files_oldest_first_and_the_rest_wait(tmp_path):
    for day, n in (("a", 4), ("b", 4), ("c", 4)):
        write_rows(tmp_path / f"{day}.jsonl", _rows(n, ord(day) * 10))
    window = take_window(tmp_path, {}, set(), max_rows=6, replay_fraction=0.0, seed=1)
    assert [f.name for f in window.files] == ["a.jsonl"] and window.waiting == ["b.jsonl", "c.jsonl"]
    big = take_window(tmp_path, {}, set(), max_rows=2, replay_fraction=0.0, seed=1)
    assert [f.name for f in big.files] == ["a.jsonl"]  # one file at least, even beyond max_rows
    full = take_window(tmp_path, {}, set(), max_rows=8, replay_fraction=0.0, seed=1)
    assert [f.name for f in full.files] == ["a.jsonl", "b.jsonl"] and full.waiting == ["c.jsonl"]  # exactly full


def test_nothing_new_replays_nothing(tmp_path):
    write_rows(tmp_path / "a.jsonl", _rows(4))
    watermark: dict = {}
    _consume(watermark, take_window(tmp_path, watermark, set(), max_rows=0, replay_fraction=0.5, seed=1), 1)
    again = take_window(tmp_path, watermark, set(), max_rows=0, replay_fraction=0.5, seed=1)
    assert again.files == [] and again.rows == [] and again.replay == []


def test_a_file_changed_after_use_is_an_error_naming_it_while_a_rewrite_of_the_same_rows_is_not(tmp_path):
    write_rows(tmp_path / "day-1.jsonl", _rows(3))
    watermark: dict = {}
    _consume(watermark, take_window(tmp_path, watermark, set(), max_rows=0, replay_fraction=0.0, seed=1), 1)
    # the same rows, keys in another order and other spacing: the same file
    (tmp_path / "day-1.jsonl").write_text("".join(json.dumps({"answer": r["answer"], "question": r["question"]},
                                                             indent=None, separators=(", ", ":")) + "\n"
                                                  for r in _rows(3)))
    assert take_window(tmp_path, watermark, set(), max_rows=0, replay_fraction=0.0, seed=1).rows == []
    with open(tmp_path / "day-1.jsonl", "a") as f:
        f.write(json.dumps({"question": "What is 9+9?", "answer": "18"}) + "\n")
    with pytest.raises(DataChangedError, match=r"day-1.jsonl: changed after firing 1 .*3 rows then, 4 now"):
        take_window(tmp_path, watermark, set(), max_rows=0, replay_fraction=0.0, seed=1)


def test_gate_questions_are_never_trained_on_and_parquet_rows_count_alike(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(_rows(6)), tmp_path / "day-1.parquet")
    gate_questions = {"What is 2+1?", "What is 4+1?"}
    window = take_window(tmp_path, {}, gate_questions, max_rows=0, replay_fraction=0.0, seed=1)
    assert window.gate_overlap == 2 and [r["question"] for r in window.rows] == [
        "What is 0+1?", "What is 1+1?", "What is 3+1?", "What is 5+1?"]
    assert window.files[0].sha256 == rows_digest(_rows(6))  # the rows' digest, whatever the file format


def test_replay_draws_its_share_from_earlier_files_seeded(tmp_path):
    write_rows(tmp_path / "day-1.jsonl", _rows(40))
    watermark: dict = {}
    _consume(watermark, take_window(tmp_path, watermark, set(), max_rows=0, replay_fraction=0.0, seed=1), 1)
    write_rows(tmp_path / "day-2.jsonl", _rows(30, 100))
    window = take_window(tmp_path, watermark, {"What is 0+1?"}, max_rows=0, replay_fraction=0.25, seed=5)
    assert len(window.rows) == 30 and len(window.replay) == 10  # 10 / (30 + 10) = 0.25
    assert all(r["id"].startswith("day-1.jsonl:") for r in window.replay)
    assert "What is 0+1?" not in {r["question"] for r in window.replay}  # a gate prompt is not replayed either
    again = take_window(tmp_path, watermark, {"What is 0+1?"}, max_rows=0, replay_fraction=0.25, seed=5)
    assert again.replay == window.replay


# ----- pruning --------------------------------------------------------------------------------------------------

def _checkpoint(paths, k: int, pass_at_1=None) -> None:
    from areal_pipeline.checksums import write_checksums
    from areal_pipeline.run_dir import write_json

    paths.checkpoint(k).mkdir(parents=True)
    (paths.checkpoint(k) / "weights").write_text(str(k))
    write_checksums(paths.checkpoint(k))
    if pass_at_1 is not None:
        write_json(paths.evaluation(k), {"pass_at_1": pass_at_1})


def test_pruning_keeps_the_newest_the_best_and_the_pinned(tmp_path):
    from areal_pipeline.pipeline import prunable_checkpoints
    from areal_pipeline.run_dir import RunPaths, pin_checkpoint

    paths = RunPaths(tmp_path)
    for k, score in ((2, 0.5), (4, 0.95), (6, 0.9), (8, 0.7), (10, 0.7)):
        _checkpoint(paths, k, score)
    assert prunable_checkpoints(paths, 2, keep_best=False) == [2, 4, 6]
    assert prunable_checkpoints(paths, 2, keep_best=True) == [2, 6]  # 4 scored best
    pin_checkpoint(tmp_path, 2)
    assert prunable_checkpoints(paths, 2, keep_best=True) == [6]
    assert paths.pinned_checkpoints() == {2}


def test_status_reads_an_unfinished_firing_without_a_lock_holder_as_killed(tmp_path):
    from areal_pipeline.recurring.ledger import lock_is_held
    from areal_pipeline.recurring.status import line_status, status_text

    ledger = Ledger.new(tmp_path / "ledger.json", "l", "/models/base")
    firing = ledger.start_firing("firing", "run-1", ["trainer.optimizer.lr=1e-4"])
    firing["run_id"] = "l-0001"
    assert not lock_is_held(tmp_path)
    (shown,) = line_status(ledger, busy=False)["firings"]
    assert (shown["decision"], shown["state"]) == ("failed", "killed")
    with line_lock(tmp_path, 1.0):
        assert lock_is_held(tmp_path)
        (shown,) = line_status(ledger, busy=lock_is_held(tmp_path))["firings"]
        assert (shown["decision"], shown["state"]) == (None, "running")
    assert not lock_is_held(tmp_path)
    status = line_status(ledger)
    assert status["champion"] == {"run_id": None, "iteration": 0, "checkpoint": "/models/base", "gate": None,
                                  "firing": None}
    assert "champion the base model" in status_text(status) and "firing 1: failed" in status_text(status)
