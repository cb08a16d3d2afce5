"""`areal-pipeline sweep`'s plan: the runs a set of axes makes, their ids, and bad input refused before anything
starts, with the config loader's own message; a failing run and a stop signal, through the sweep's own temporary
API. (3 runs at once on a Prefect server on PostgreSQL: tests/test_prefect_postgres.py.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import psutil
import pytest

from areal_pipeline.config import ConfigError
from flows.sweep import SweepError, format_table, plan
from test_flows import REPO, cli, fast_overrides, stop_serve, wait_until

CONFIG = str(REPO / "configs" / "tiny_cpu.yaml")


def test_the_cartesian_product_in_order_with_readable_run_ids(tmp_path):
    runs = plan(CONFIG, [f"output_dir={tmp_path}", "trainer.optimizer.lr=1e-3,5e-4", "rollout.gconfig.n_samples=4,8"])
    assert [r["run_id"] for r in runs] == ["tiny-cpu-lr=1e-3-n_samples=4", "tiny-cpu-lr=1e-3-n_samples=8",
                                          "tiny-cpu-lr=5e-4-n_samples=4", "tiny-cpu-lr=5e-4-n_samples=8"]
    assert runs[1]["overrides"] == [f"output_dir={tmp_path}", "trainer.optimizer.lr=1e-3",
                                    "rollout.gconfig.n_samples=8"]
    assert runs[1]["run_dir"] == str(tmp_path / "tiny-cpu-lr=1e-3-n_samples=8")


def test_keys_that_end_alike_are_named_in_full_and_values_are_made_path_safe(tmp_path):
    runs = plan(CONFIG, [f"output_dir={tmp_path}", "trainer.optimizer.lr=1e-3,2e-3", "seed=1,2"], run_id="base")
    assert runs[0]["run_id"] == "base-lr=1e-3-seed=1"
    runs = plan(CONFIG, [f"output_dir={tmp_path}", "inference.num_threads=1,2", "trainer.num_threads=1,2"], run_id="b")
    assert runs[0]["run_id"] == "b-inference.num_threads=1-trainer.num_threads=1"
    runs = plan(CONFIG, [f"output_dir=a/b,{tmp_path}/c d"], run_id="p")
    flat = str(tmp_path)[1:].replace("/", "_")
    assert [r["run_id"] for r in runs] == ["p-output_dir=a_b", f"p-output_dir={flat}_c_d"]


@pytest.mark.parametrize("axes, message", [
    (["trainer.optimizer.lrr=1e-3,2e-3"],
     "unknown config key 'trainer.optimizer.lrr'. did you mean trainer.optimizer.lr"),
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
    done = subprocess.run([sys.executable, "-m", "cli", "sweep", "--config", CONFIG,
                           "trainer.optimizer.lrr=1e-3,2e-3"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith(
        "config error: sweep run tiny-cpu-lrr=1e-3: override 'trainer.optimizer.lrr=1e-3': unknown config key"), \
        done.stderr
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


@pytest.fixture(scope="module")
def sweep_env(tmp_path_factory) -> dict:
    """The sweep's own temporary API (no PREFECT_API_URL), on a database made once for the module."""
    env = {**os.environ, "PREFECT_HOME": str(tmp_path_factory.mktemp("prefect-home"))}
    env.pop("PREFECT_API_URL", None)
    return env


def _sweep(tmp_path, model_dir, env, *axes: str, iterations: int = 2) -> subprocess.Popen:
    fixed = [o for o in fast_overrides(tmp_path, model_dir, iterations=iterations)
             if not o.startswith(("run_id=", "trainer.optimizer.lr="))]
    return cli("sweep", "--config", CONFIG, "--run-id", "sw", "--max-parallel", "2", *fixed, *axes, env=env,
               start_new_session=True)


def test_a_failing_run_does_not_stop_the_others(tiny_model_dir, tmp_path, sweep_env):
    """One run fails at once (a file where its iteration 1 goes: a deterministic error, not retried); the other
    finishes, the table shows both, and the command exits 1 naming the failed one."""
    (tmp_path / "sw-lr=2e-3").mkdir()
    (tmp_path / "sw-lr=2e-3" / "iter_1").write_text("in the way")
    sweep = _sweep(tmp_path, tiny_model_dir, sweep_env, "trainer.optimizer.lr=1e-3,2e-3")
    try:
        out, _ = sweep.communicate(timeout=300)
    finally:
        if sweep.poll() is None:
            stop_serve(sweep)
    assert sweep.returncode == 1, out[-4000:]
    table = out[out.index("\nrun ") + 1:].splitlines()
    assert table[2].split()[:3] == ["sw-lr=1e-3", "Completed", "2"], out[-3000:]
    assert table[3].split()[:2] == ["sw-lr=2e-3", "Failed"], out[-3000:]
    assert out.strip().splitlines()[-1].startswith("sweep failed: RuntimeError: 1 of 2 runs failed: sw-lr=2e-3: "
                                                   "exit code 1, flow run Failed"), out[-3000:]


def test_a_stop_signal_stops_every_run_and_leaves_no_process(tiny_model_dir, tmp_path, sweep_env):
    """One run's process is killed (SIGKILL: it records nothing), then SIGTERM goes to the sweep while the other
    trains: the sweep records the killed run's flow runs as crashed, the other run stops its services and records
    its own crash, the command exits 143 within seconds, and nothing it started is left."""
    sweep = _sweep(tmp_path, tiny_model_dir, sweep_env, "trainer.optimizer.lr=1e-3,2e-3", iterations=50)
    try:
        wait_until(lambda: all((tmp_path / f"sw-lr={lr}" / "iter_1" / "orchestration.json").exists()
                               for lr in ("1e-3", "2e-3")) or sweep.poll() is not None, 240, "both runs to train")
        assert sweep.poll() is None, sweep.communicate()[0][-4000:]
        started = psutil.Process(sweep.pid).children(recursive=True)
        # the API server; per run its process, inference server, trainer, ...
        assert len(started) >= 6, [" ".join(p.cmdline())[:120] for p in started]
        killed_log = str(tmp_path / "sw-lr=2e-3" / "logs" / "sweep.log")
        (killed,) = [p for p in psutil.Process(sweep.pid).children()
                     if any(f.path == killed_log for f in p.open_files())]
        killed.kill()
        killed.wait(30)
        sweep.send_signal(signal.SIGTERM)
        out, _ = sweep.communicate(timeout=25)
    finally:
        if sweep.poll() is None:
            stop_serve(sweep)
    assert sweep.returncode == 143, out[-12000:]
    assert "finished sw-lr=1e-3: Crashed" in out and "finished sw-lr=2e-3: Crashed" in out, out[-12000:]
    # by the sweep: the killed run's train flow run first, then any run below it still unfinished (the iteration it
    # was in, under Prefect's random name if it had not named itself yet; none between two iterations)
    marked = [line for line in out.splitlines() if "left unfinished by an ended process, marked Crashed: " in line]
    assert len(marked) == 1 and re.search(r"Crashed: sw-lr=2e-3(, [^ ,]+)*$", marked[0]), out[-12000:]
    wait_until(lambda: not [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], 60,
               "every process the sweep started to exit")


def test_the_runs_an_ended_process_left_unfinished_are_marked_crashed_and_no_other(prefect_api):
    """crash_unfinished_runs, against the worker's Prefect API: the flow run and the unfinished runs below it,
    at every depth, become Crashed with the reason; a finished run below it, and a running run elsewhere, stay."""
    from prefect import Task, flow, get_client
    from prefect.states import Completed, Running

    from flows.labels import crash_unfinished_runs

    @flow(name="ended-process-test")
    def placeholder():
        pass

    def tracker_task():
        pass

    with get_client(sync_client=True) as client:
        def flow_run(name: str, state, parent=None):
            parent_task_run = None
            if parent is not None:  # as Prefect links a subflow: a task run of the parent stands for it
                parent_task_run = client.create_task_run(Task(tracker_task), flow_run_id=parent.id,
                                                         dynamic_key=name, name=f"tracker-{name}").id
            run = client.create_flow_run(placeholder, name=name, parent_task_run_id=parent_task_run)
            client.set_flow_run_state(run.id, state, force=True)
            return run

        top = flow_run("ended/top", Running())
        done = flow_run("ended/iter-1", Completed(), top)
        running = flow_run("ended/iter-2", Running(), top)
        deeper = flow_run("ended/iter-2/eval", Running(), running)
        elsewhere = flow_run("ended/elsewhere", Running())
        crashed = crash_unfinished_runs(client, client.read_flow_run(top.id), "its process ended (exit code -9)")
        states = {run.name: client.read_flow_run(run.id).state for run in (top, done, running, deeper, elsewhere)}
    assert sorted(crashed) == ["ended/iter-2", "ended/iter-2/eval", "ended/top"]
    assert {name: state.type.value for name, state in states.items()} == {
        "ended/top": "CRASHED", "ended/iter-1": "COMPLETED", "ended/iter-2": "CRASHED", "ended/iter-2/eval": "CRASHED",
        "ended/elsewhere": "RUNNING"}
    assert states["ended/iter-2"].message == "its process ended (exit code -9)"
