"""bench/chaos.py --quick (issue 35): random SIGKILLs of real runs, synchronous and asynchronous, survived with no
prompt skipped or trained twice and, synchronously, the reference's final weights; and its ledger catches a
batch that skipped a prompt or trained one twice."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest

from areal_pipeline.data.shards import read_manifest, read_table, write_table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))


@pytest.fixture(scope="module")
def quick_chaos(tmp_path_factory):
    env = {**os.environ, "TMPDIR": str(tmp_path_factory.mktemp("chaos"))}
    done = subprocess.run([sys.executable, "bench/chaos.py", "--quick", "--keep"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=1500)
    work = re.search(r"work directory kept: (\S+)", done.stdout)
    yield done, Path(work.group(1)) if work else None
    if work:
        shutil.rmtree(work.group(1), ignore_errors=True)


def test_quick_chaos_is_survived_in_both_modes(quick_chaos):
    done, _ = quick_chaos
    assert done.returncode == 0, done.stdout[-20000:] + done.stderr[-3000:]  # a hung run's stacks included
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    for mode in ("sync", "async"):
        assert figures[mode]["kills"] == figures[mode]["kills_survived"] == 2, figures
        assert figures[mode]["prompts_skipped"] == figures[mode]["prompts_trained_twice"] == 0, figures
        assert figures[mode]["rounds_finished"] == figures[mode]["rounds"], figures
    assert figures["sync"]["weights_equal"] is True
    assert figures["async"]["max_staleness"] <= 1


def test_what_the_chaos_run_left_on_disk_says_the_same(quick_chaos):
    """The figures, checked from the runs' own files rather than from the benchmark's: two kills a mode in its
    log, every round's run finished each iteration once, and the synchronous rounds' final weights are the
    reference's tensor for tensor."""
    import torch
    from safetensors.torch import load_file

    done, work = quick_chaos
    assert work is not None, done.stdout[-3000:]
    for mode in ("sync", "async"):
        kills = re.findall(rf"^\[{mode}\] round \d+: kill (.+?) at [\d.]+ s \(pid [\d, ]+\) -> (.+)$", done.stdout,
                           re.MULTILINE)
        assert len(kills) == 2 and all("HUNG" not in after for _, after in kills), kills
        rounds = sorted((work / mode).glob("round-*/faults"))
        assert rounds, list((work / mode).iterdir())
        for run_dir in rounds:
            finished = [json.loads(line)["iteration"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            assert sorted(finished) == [1, 2, 3], (run_dir, finished)
    final = "checkpoints/step_3/model/model.safetensors"
    reference = load_file(str(work / "sync" / "reference" / "faults" / final))
    for run_dir in sorted((work / "sync").glob("round-*/faults")):
        weights = load_file(str(run_dir / final))
        assert weights.keys() == reference.keys()
        assert all(torch.equal(weights[name], reference[name]) for name in reference), run_dir


def test_the_ledger_finds_a_skipped_prompt_and_one_trained_twice(quick_chaos):
    from chaos import ledger

    _, work = quick_chaos
    assert work is not None
    run_dir = next((work / "sync").glob("round-*/faults"))
    assert ledger(run_dir)["skipped"] == ledger(run_dir)["trained_twice"] == []

    batch = run_dir / "iter_2" / "batch"
    manifest = read_manifest(batch)
    table = read_table(batch, schema=None)
    first, second = table.column("prompt_id")[0].as_py(), None
    for prompt in table.column("prompt_id").to_pylist():
        if prompt != first:
            second = prompt
            break
    # prompt `first` left out; the first row of `second` trained twice
    kept = table.filter(pc.not_equal(table.column("prompt_id"), first))
    row = kept.filter(pc.equal(kept.column("prompt_id"), second)).slice(0, 1)
    write_table(pa.concat_tables([kept, row]), batch, run_id=manifest["run_id"], iteration=2, overwrite=True)

    found = ledger(run_dir)
    assert found["skipped"] == [f"iter 2: {first}"]
    assert found["trained_twice"] == [f"iter 2: ('{second}', {row.column('sample_idx')[0].as_py()}) x2"]
