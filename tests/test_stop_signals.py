"""Stopping a run as users do: Ctrl-C, SIGTERM, to the process or its group, with Prefect's API a temporary server
of the run's own or a standing one; real processes, a real Prefect API server on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from areal_pipeline.forkserver import processes_of
from test_flows import cli, fast_overrides, wait_until

# The forkserver's exit after the run's (it holds the run's stdout): a deadline for a process that must not linger.
# The run's own exit has none of its own: that it unwound before shutdown.py's forced exit (at 8 s) is what the
# output says ("forcing" absent), whatever the machine's load.
FORKSERVER_EXITS_WITHIN_S = 60


def _start_cli_train(tmp_path: Path, model_dir: Path, run_id: str, env: dict, *extra: str) -> subprocess.Popen:
    # its own session, as a shell's foreground job is its own process group: signals sent to the group reach
    # the run and every child that shares the group, and nothing of pytest's
    return cli("train", "--config", "configs/tiny_cpu.yaml", *fast_overrides(tmp_path, model_dir, run_id=run_id,
                                                                             iterations=50), *extra,
               env=env, start_new_session=True)


def _stop(run: subprocess.Popen, signum: int, to_group: bool) -> str:
    """The run's output, once it has exited after the signal. The output ends later, once the last process
    holding the run's stdout exits: the services' forkserver, which notices its parent gone and then finalizes an
    interpreter that imported torch (seconds on a loaded machine); that has a deadline of its own."""
    output: list[str] = []
    if to_group:
        os.killpg(run.pid, signum)
    else:
        run.send_signal(signum)
    reader = threading.Thread(target=lambda: output.append(run.stdout.read()), daemon=True)
    reader.start()
    try:
        run.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        reader.join(30)
        raise AssertionError(f"still running 60 s after {signal.Signals(signum).name}:\n{''.join(output)[-3000:]}")
    reader.join(FORKSERVER_EXITS_WITHIN_S)
    assert not reader.is_alive(), f"the run's stdout still open {FORKSERVER_EXITS_WITHIN_S} s after it exited"
    return output[0]


@pytest.fixture(scope="module")
def temporary_api_home(tmp_path_factory):
    """A PREFECT_HOME shared by this module's runs without PREFECT_API_URL: the first one creates the temporary
    API server's database, the others reuse it (as a user's runs do)."""
    return tmp_path_factory.mktemp("prefect-home-temporary-api")


@pytest.mark.parametrize("signum, to_group, api, rerun", [
    (signal.SIGINT, True, "temporary", True),  # Ctrl-C in a terminal
    (signal.SIGINT, False, "temporary", False),
    (signal.SIGTERM, True, "temporary", False),  # `timeout`, a supervisor stopping the job
    (signal.SIGTERM, False, "temporary", False),  # `kill`
    (signal.SIGINT, True, "standing", False),
    (signal.SIGTERM, False, "standing", True),
], ids=lambda v: signal.Signals(v).name if isinstance(v, signal.Signals) else v)
def test_a_stop_signal_ends_the_run_promptly_and_the_same_run_id_continues_it(
        prefect_api, temporary_api_home, tiny_model_dir, tmp_path, signum, to_group, api, rerun):
    """Ctrl-C (SIGINT to the foreground group) or SIGTERM (`kill`, `timeout`, a supervisor), to the run's pid or
    its group, with Prefect's API a temporary server of the run's own or a standing one: the run stops its
    servers and trainer, says so, and exits with the signal's status, unwound before the forced exit; rerunning
    the same run id continues it (once per kind of API: the continuation does not depend on the signal)."""
    env = dict(os.environ)
    if api == "standing":
        env["PREFECT_API_URL"] = prefect_api
    else:
        env.pop("PREFECT_API_URL", None)
        env["PREFECT_HOME"] = str(temporary_api_home)
    run = _start_cli_train(tmp_path, tiny_model_dir, "stop", env)
    # once iteration 2's rollout is done where the rerun is to continue after a finished iteration, else 1's
    marker = tmp_path / "stop" / f"iter_{2 if rerun else 1}" / "rollout" / "manifest.json"
    wait_until(lambda: marker.exists() or run.poll() is not None, 600, f"{marker.parent.parent.name}'s rollout",
               interval=0.05)
    assert run.poll() is None, run.stdout.read()
    assert processes_of(run.pid, forkserver=False)
    out = _stop(run, signum, to_group)
    assert run.returncode == 128 + signum, out[-3000:]
    name = signal.Signals(signum).name
    assert f"interrupted by {name}: servers and trainer were stopped" in out, out[-3000:]
    assert "forcing" not in out and "still running" not in out, out[-3000:]  # it unwound, no forced exit
    assert "Retrying" not in out, out[-3000:]
    # servers, trainer and the temporary API server (all carry the run's pid) are gone
    wait_until(lambda: processes_of(run.pid) == [], 30, "the run's processes to exit")
    if not rerun:
        return

    again = cli("train", "--config", "configs/tiny_cpu.yaml",
                *fast_overrides(tmp_path, tiny_model_dir, run_id="stop", iterations=3), env=env)
    out, _ = again.communicate(timeout=600)
    assert again.returncode == 0, out[-3000:]
    finished = [json.loads(line)["iteration"] for line in (tmp_path / "stop" / "metrics.jsonl").read_text().splitlines()]
    assert finished == [1, 2, 3], out[-3000:]
    assert "continuing at 2" in out or "continuing at 3" in out, out[-3000:]


_REPLACED_HANDLER = r'''
import signal, sys, time
from areal_pipeline import shutdown

shutdown.FORCED_EXIT_AFTER_S = 2.0
shutdown.install_handlers()
shutdown.register("a marker", lambda: print("cleaned up", flush=True))
shutdown.register_final_report("the stuck report", lambda: time.sleep(3600))
shutdown.register_final_report("the failing report", lambda: 1 / 0)
shutdown.register_final_report("the marker's end", lambda: print("reported", flush=True))
forgotten = shutdown.register_final_report("a forgotten report", lambda: print("not forgotten", flush=True))
shutdown.unregister(forgotten)

def slow_handler(signum, frame):  # as Prefect's: it reports the crash to an API that no longer answers
    time.sleep(3600)

signal.signal(signal.SIGTERM, slow_handler)
print("ready", flush=True)
time.sleep(3600)
'''


def test_the_stop_starts_at_the_signal_whatever_handler_another_library_put_in_place():
    """A library's SIGTERM handler that never returns (Prefect's, reporting to a dead API) in place of the
    project's: the registered clean-ups still run at the signal, and the forced exit still ends the process, naming
    where each thread was (the slow handler's line among them), after its final reports: one that never returns
    and one that fails are named, and neither holds the exit or the others; an unregistered one does not run."""
    import sys

    process = subprocess.Popen([sys.executable, "-c", _REPLACED_HANDLER], stdout=subprocess.PIPE, text=True,
                               stderr=subprocess.STDOUT)
    try:
        assert process.stdout.readline().strip() == "ready"
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=60)  # the slow handler alone would hold it an hour
        assert process.returncode == 128 + signal.SIGTERM and "cleaned up" in out, out
        assert "still running 2 s after the stop signal" in out, out
        stacks = out[out.index("What each thread was doing:"):]
        assert "Thread 0x" in stacks and "in slow_handler" in stacks, out
        assert "reported" in stacks and "not forgotten" not in out, out
        assert "could not report the stuck report before exiting: no answer within 2 s" in stacks, out
        assert "could not report the failing report before exiting: ZeroDivisionError" in stacks, out
    finally:
        process.kill()
        process.wait()


_HELD_FLOW_RUN = r'''
import signal, time
from prefect import flow, runtime
from areal_pipeline import shutdown
from flows import labels

shutdown.FORCED_EXIT_AFTER_S = 2.0
shutdown.install_handlers()

def held(signum, frame):  # as Prefect's own handler with an API that does not answer: the unwinding never starts
    time.sleep(3600)

@flow(name="held-iteration")
def iteration():  # as a firing's train run: a flow run with a block of its own below one with a block
    with labels.crashed_if_forced_to_exit(runtime.flow_run.id):
        signal.signal(signal.SIGTERM, held)
        print("ready", flush=True)
        time.sleep(3600)

@flow(name="held-train")
def train():
    with labels.crashed_if_forced_to_exit(runtime.flow_run.id):
        print("train", runtime.flow_run.id, flush=True)
        iteration()

train()
'''


def test_a_forced_exit_records_the_crash_of_the_flow_run_and_the_runs_below_it(prefect_api):
    """A flow run whose unwinding never starts after SIGTERM (its handler held, as Prefect's is with an API that does
    not answer): the forced exit marks it and its running child flow run Crashed through the API before it exits,
    where the UI would otherwise show both running until the run id was started again; once each, though the child
    has a block of its own."""
    import sys

    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    process = subprocess.Popen([sys.executable, "-c", _HELD_FLOW_RUN], stdout=subprocess.PIPE, text=True,
                               stderr=subprocess.STDOUT, env=env)
    try:
        lines = [process.stdout.readline()]  # Prefect's log lines among them
        while lines[-1] not in ("ready\n", ""):
            lines.append(process.stdout.readline())
        assert lines[-1] == "ready\n", lines
        top = next(line.split()[1] for line in lines if line.startswith("train "))
        process.send_signal(signal.SIGTERM)
        out, _ = process.communicate(timeout=120)  # the held handler alone would keep it an hour
        assert process.returncode == 128 + signal.SIGTERM, out
        assert "still running 2 s after the stop signal" in out and "could not report" not in out, out
    finally:
        process.kill()
        process.wait()
    with get_client(sync_client=True) as client:
        train = client.read_flow_run(top)
        below = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[train.id])))
        histories = [[state.type.value for state in client.read_flow_run_states(run.id)] for run in [train, *below]]
    why = "its process was forced to exit after a stop signal, before recording its end"
    assert len(below) == 1, below
    assert (train.state.type.value, train.state.message) == ("CRASHED", why), train.state
    assert (below[0].state.type.value, below[0].state.message) == ("CRASHED", why), below[0].state
    assert [history.count("CRASHED") for history in histories] == [1, 1], histories


_FORKED_CHILD = r'''
import os, signal, sys, time
from areal_pipeline import shutdown

shutdown.install_handlers()
child = os.fork()
if child == 0:
    signal.signal(signal.SIGTERM, lambda *a: os._exit(0))
    time.sleep(60)
    os._exit(1)
time.sleep(0.5)
os.kill(child, signal.SIGTERM)  # as a pool stops a worker
os.waitpid(child, 0)
time.sleep(1)
print("stop requested:", shutdown.requested_by(), flush=True)
'''


def test_a_signal_to_a_forked_child_is_not_taken_for_one_to_the_parent():
    import sys

    out = subprocess.run([sys.executable, "-c", _FORKED_CHILD], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "stop requested: None" in out.stdout, out.stdout + out.stderr


def test_evaluate_rescore_and_a_sweep_would_record_their_crash_on_a_forced_exit_for_their_whole_body(
        prefect_api, tiny_model_dir, tmp_path, monkeypatch):
    """As `train`, the other flows a user starts hold a forced exit's report for their own flow run while they run:
    for their whole body (here until the bad input they were given fails them; a sweep also while it waits on its
    runs); the report is withdrawn when the flow ends."""
    from prefect import task

    import flows.sweep
    from areal_pipeline import shutdown
    from flows.evaluate import evaluate
    from flows.rescore import rescore
    from flows.sweep import sweep

    registered, live = [], {}
    real_register, real_unregister = shutdown.register_final_report, shutdown.unregister

    def register(what, report):
        handle = real_register(what, report)
        registered.append(what)
        live[handle] = what
        return handle

    def unregister(handle):
        live.pop(handle, None)
        real_unregister(handle)

    monkeypatch.setattr(shutdown, "register_final_report", register)
    monkeypatch.setattr(shutdown, "unregister", unregister)

    def report_of(state) -> str:
        return f"flow run {state.state_details.flow_run_id}'s crash"

    failed = evaluate(config_path=str(tmp_path / "missing.yaml"), return_state=True)
    assert failed.is_failed() and registered == [report_of(failed)] and not live, (failed, registered, live)
    registered.clear()
    failed = rescore(run_id="missing", scorer="r", output_dir=str(tmp_path), return_state=True)
    assert failed.is_failed() and registered == [report_of(failed)] and not live, (failed, registered, live)
    registered.clear()
    failed = sweep(config_path="configs/tiny_cpu.yaml", max_parallel=0, return_state=True)
    assert failed.is_failed() and registered == [report_of(failed)] and not live, (failed, registered, live)

    seen_by_runs = []

    @task(name="run")
    def run_one(config_path, run_id, overrides, iterations, run_dir, api_url):  # a run that ends at once
        seen_by_runs.append(sorted(live.values()))
        return {"run_id": run_id, "state": "COMPLETED"}

    monkeypatch.setattr(flows.sweep, "run_one", run_one)
    done = sweep(config_path="configs/tiny_cpu.yaml", axes=[f"output_dir={tmp_path}", f"model.path={tiny_model_dir}",
                                                            "seed=1,2"], return_state=True)
    assert done.is_completed() and seen_by_runs == [[report_of(done)]] * 2 and not live, (done, seen_by_runs, live)
