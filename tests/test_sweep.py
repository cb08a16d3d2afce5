"""`areal-pipeline sweep`'s plan: the runs a set of axes makes, their ids, and bad input refused before anything
starts, with the config loader's own message. (The sweep running 3 runs at once on a real Prefect server is in
tests/test_prefect_postgres.py.)"""

from __future__ import annotations

import subprocess
import sys

import pytest

from areal_pipeline.config import ConfigError
from flows.sweep import SweepError, format_table, plan
from test_flows import REPO

CONFIG = str(REPO / "configs" / "tiny_cpu.yaml")


def test_the_cartesian_product_in_order_with_readable_run_ids(tmp_path):
    runs = plan(CONFIG, [f"output_dir={tmp_path}", "trainer.optimizer.lr=1e-3,5e-4", "rollout.gconfig.n_samples=4,8"])
    assert [r["run_id"] for r in runs] == ["tiny-cpu-lr=1e-3-n_samples=4", "tiny-cpu-lr=1e-3-n_samples=8",
                                          "tiny-cpu-lr=5e-4-n_samples=4", "tiny-cpu-lr=5e-4-n_samples=8"]
    assert runs[1]["overrides"] == [f"output_dir={tmp_path}", "trainer.optimizer.lr=1e-3", "rollout.gconfig.n_samples=8"]
    assert runs[1]["run_dir"] == str(tmp_path / "tiny-cpu-lr=1e-3-n_samples=8")


def test_keys_that_end_alike_are_named_in_full_and_values_are_made_path_safe(tmp_path):
    runs = plan(CONFIG, [f"output_dir={tmp_path}", "trainer.optimizer.lr=1e-3,2e-3", "seed=1,2"], run_id="base")
    assert runs[0]["run_id"] == "base-lr=1e-3-seed=1"
    runs = plan(CONFIG, [f"output_dir={tmp_path}", "inference.num_threads=1,2", "trainer.num_threads=1,2"], run_id="b")
    assert runs[0]["run_id"] == "b-inference.num_threads=1-trainer.num_threads=1"
    runs = plan(CONFIG, [f"output_dir=a/b,{tmp_path}/c d"], run_id="p")
    assert [r["run_id"] for r in runs] == ["p-output_dir=a_b", f"p-output_dir={str(tmp_path)[1:].replace('/', '_')}_c_d"]


@pytest.mark.parametrize("axes, message", [
    (["trainer.optimizer.lrr=1e-3,2e-3"], "unknown config key 'trainer.optimizer.lrr'. did you mean trainer.optimizer.lr"),
    (["trainer.optimizer.lr=1e-3,-1"], "sweep run tiny-cpu-lr=-1: trainer.optimizer.lr=-1.0: must be > 0"),
])
def test_a_bad_key_or_value_is_the_config_loaders_error(axes, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        plan(CONFIG, axes)


@pytest.mark.parametrize("axes, message", [
    (["lr"], "expected key=v1,v2"),
    (["seed=1,,2"], "an empty value"),
    (["seed=1,1"], "a value is repeated"),
    (["run_id=a,b"], "run_id cannot be swept"),
    (["seed=1,2", "seed=3"], "'seed' is given twice"),
])
def test_malformed_axes_are_refused(axes, message):
    with pytest.raises(SweepError, match=message):
        plan(CONFIG, axes)


def test_the_command_refuses_bad_input_before_anything_starts():
    done = subprocess.run([sys.executable, "-m", "areal_pipeline.cli", "sweep", "--config", CONFIG,
                           "trainer.optimizer.lrr=1e-3,2e-3"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(
        "config error: sweep run tiny-cpu-lrr=1e-3: override 'trainer.optimizer.lrr=1e-3': unknown config key"), done.stderr
    assert "Prefect API" not in done.stdout  # refused before any API server started


def test_the_table_shows_each_runs_figures():
    table = format_table([
        {"run_id": "a-lr=1e-3", "state": "Completed", "iterations": 30, "reward_first": 0.31, "reward_last": 0.8,
         "eval_pass_at_1_first": 0.1, "eval_pass_at_1_last": 0.9, "wall_s": 61.2},
        {"run_id": "a-lr=1e-2", "state": "Failed", "error": "exit code 1"}]).splitlines()
    assert table[0].split() == ["run", "state", "iters", "reward", "first", "reward", "last", "pass@1", "first",
                                "pass@1", "last", "wall"]
    assert table[2].split() == ["a-lr=1e-3", "Completed", "30", "0.310", "0.800", "0.100", "0.900", "61", "s"]
    assert table[3].split() == ["a-lr=1e-2", "Failed", "0", "-", "-", "-", "-", "-"]
