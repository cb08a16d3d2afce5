"""The warm launcher (flows/warm.py): real launchers on private sockets, real `areal-pipeline` commands that run
as forks of them, a real Prefect API; stops as users send them."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from test_flows import REPO, cli, fast_overrides, stop_serve, wait_for_deployment, wait_until

STOPPED_WITHIN_S = 10


def _command(*args: str, env: dict, cwd: Path = REPO, prefix: tuple[str, ...] = ()) -> subprocess.Popen:
    """`areal-pipeline *args` as a user runs it (its own session, as a shell's foreground job)."""
    return subprocess.Popen([*prefix, sys.executable, "-m", "areal_pipeline.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(command: subprocess.Popen, timeout: float = 600) -> tuple[int, str, str]:
    out, err = command.communicate(timeout=timeout)
    return command.returncode, out, err


def _status_or_none(env: dict):
    """`areal-pipeline warm status`: the launcher's, or None where none answers."""
    done = subprocess.run([sys.executable, "-m", "areal_pipeline.cli", "warm", "status"], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    return json.loads(done.stdout) if done.returncode == 0 else None


def _status(env: dict) -> dict:
    status = _status_or_none(env)
    assert status is not None, f"no launcher answers on {env['AREAL_WARM_SOCKET']}"
    return status


def _start_launcher(tmp: Path, *extra: str, env_extra: dict | None = None) -> dict:
    env = {**os.environ, "AREAL_WARM": "1", "AREAL_WARM_SOCKET": str(tmp / "warm.sock"),
           "PREFECT_HOME": str(tmp / "prefect-home"), **(env_extra or {})}
    env.pop("PREFECT_API_URL", None)
    done = subprocess.run([sys.executable, "-m", "areal_pipeline.cli", "warm", "start", *extra], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "warm launcher ready" in done.stdout, done.stdout
    _LAUNCHERS[env["AREAL_WARM_SOCKET"]] = _status(env)["pid"]
    return env


_LAUNCHERS: dict[str, int] = {}  # socket -> the launcher's pid, for the clean-up whatever a test left


def _stop_launcher(env: dict) -> None:
    """`warm stop`; then whatever of the launcher is still there (a failed test's) is killed before the checks."""
    pid = _LAUNCHERS.pop(env["AREAL_WARM_SOCKET"])
    subprocess.run([sys.executable, "-m", "areal_pipeline.cli", "warm", "stop"], env=env, cwd=REPO, timeout=120)
    try:
        launcher = psutil.Process(pid)
        left = [] if launcher.status() == psutil.STATUS_ZOMBIE else [launcher, *launcher.children(recursive=True)]
    except psutil.NoSuchProcess:
        left = []
    for process in left:
        process.kill()
    assert not left, [" ".join(p.cmdline()) for p in left]
    assert not Path(env["AREAL_WARM_SOCKET"]).exists()


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    env = _start_launcher(tmp_path_factory.mktemp("warm"))
    yield env
    _stop_launcher(env)


def test_a_command_runs_as_a_fork_of_the_launcher_in_its_own_directory_environment_and_terminal(
        launcher, tiny_model_dir, tmp_path):
    shutil.copy(REPO / "configs" / "tiny_cpu.yaml", tmp_path / "mine.yaml")
    before = _status(launcher)["runs_started"]
    env = {**launcher, "WARM_TEST_RUN_ID": "from-env"}  # read by the config (an interpolation), at run time
    # a relative config and output_dir: the command's working directory, not the launcher's (the repository)
    overrides = [o for o in fast_overrides(Path("out"), tiny_model_dir, iterations=2) if not o.startswith("run_id=")]
    code, out, err = _finish(_command("train", "--config", "mine.yaml", *overrides, "run_id=${oc.env:WARM_TEST_RUN_ID}",
                                      env=env, cwd=tmp_path))
    assert code == 0, out[-3000:] + err[-3000:]
    assert "started cold" not in err, err
    assert _status(launcher)["runs_started"] == before + 1
    # its output is on the command's own stdout, the run's files where the command's directory puts them
    assert "run from-env: 2 iterations" in out, out[-3000:]
    metrics = (tmp_path / "out" / "from-env" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["iteration"] for line in metrics] == [1, 2]


def test_a_failing_command_exits_with_its_status_and_message(launcher, tiny_model_dir, tmp_path):
    before = _status(launcher)["runs_started"]
    code, out, err = _finish(_command("train", "--config", "configs/tiny_cpu.yaml", f"output_dir={tmp_path}",
                                      "no_such_key=1", env=launcher))
    assert code == 1, out + err
    assert "config error" in err and "no_such_key" in err, err
    assert _status(launcher)["runs_started"] == before + 1


def test_a_run_with_other_prefect_settings_starts_its_own_temporary_api_as_a_fork(launcher, tiny_model_dir,
                                                                                  tmp_path):
    env = {**launcher, "PREFECT_HOME": str(tmp_path / "another-prefect-home")}
    before = _status(launcher)["runs_started"]
    code, out, err = _finish(_command("train", "--verbose", "--config", "configs/tiny_cpu.yaml",
                                      *fast_overrides(tmp_path, tiny_model_dir, run_id="own-api", iterations=1),
                                      env=env))
    assert code == 0, out[-3000:] + err[-3000:]
    assert _status(launcher)["runs_started"] == before + 1
    assert "Prefect API: temporary server" in out + err, (out + err)[-3000:]
    assert (tmp_path / "another-prefect-home" / "prefect.db").exists()  # its own database: its own home's


def test_a_sweep_and_each_of_its_runs_are_forks_of_the_launcher(launcher, tiny_model_dir, tmp_path):
    before = _status(launcher)["runs_started"]
    fixed = [o for o in fast_overrides(tmp_path, tiny_model_dir, iterations=1)
             if not o.startswith(("run_id=", "trainer.optimizer.lr="))]
    code, out, err = _finish(_command("sweep", "--config", "configs/tiny_cpu.yaml", "--run-id", "sw", "--max-parallel",
                                      "2", *fixed, "trainer.optimizer.lr=1e-3,2e-3", env=launcher))
    assert code == 0, out[-3000:] + err[-3000:]
    assert "started cold" not in err, err
    assert _status(launcher)["runs_started"] == before + 3  # the sweep, then each run (python -m flows.sweep --child)
    for lr in ("1e-3", "2e-3"):
        metrics = (tmp_path / f"sw-lr={lr}" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["iteration"] for line in metrics] == [1], out[-3000:]


@pytest.mark.parametrize("how", ["ctrl-c", "command-killed"])
def test_stopping_the_command_stops_the_run_and_everything_it_started(launcher, tiny_model_dir, tmp_path, how):
    run = _command("train", "--config", "configs/tiny_cpu.yaml",
                   *fast_overrides(tmp_path, tiny_model_dir, run_id="stop", iterations=50), env=launcher)
    marker = tmp_path / "stop" / "iter_2" / "rollout" / "manifest.json"
    wait_until(lambda: marker.exists() or run.poll() is not None, 600, "iteration 2's rollout", interval=0.05)
    assert run.poll() is None, run.communicate()
    launcher_pid = _status(launcher)["pid"]
    [forked] = [p for p in psutil.Process(launcher_pid).children() if "train" in " ".join(p.cmdline())]
    started = forked.children(recursive=True)
    assert any("inference.server" in " ".join(p.cmdline()) for p in started), [p.cmdline() for p in started]
    sent = time.monotonic()
    if how == "ctrl-c":
        os.killpg(run.pid, signal.SIGINT)  # the terminal's Ctrl-C: the command's process group
        code, out, err = _finish(run, 60)
        assert code == 128 + signal.SIGINT, out[-3000:] + err[-3000:]
        assert "interrupted by SIGINT: servers and trainer were stopped" in err, err[-3000:]
    else:
        run.kill()  # SIGKILL: the command can forward nothing; the launcher sees its connection close
        run.wait()
    for process in [forked, *started]:
        wait_until(lambda: not process.is_running() or process.status() == psutil.STATUS_ZOMBIE,
                   STOPPED_WITHIN_S - (time.monotonic() - sent) + 5, f"{process.pid} to exit")
    assert time.monotonic() - sent < STOPPED_WITHIN_S + 5
    wait_until(lambda: _status(launcher)["running"] == [], 10, "the launcher to reap the run")


def test_a_command_whose_launcher_is_killed_lasts_as_long_as_its_run_and_still_stops_it(tiny_model_dir, tmp_path):
    """kill -9 of the launcher: the command cannot learn the run's status any more, but it still forwards Ctrl-C
    and ends only when the run has."""
    env = _start_launcher(tmp_path)
    launcher = psutil.Process(_status(env)["pid"])
    run = _command("train", "--config", "configs/tiny_cpu.yaml",
                   *fast_overrides(tmp_path, tiny_model_dir, run_id="orphan", iterations=50), env=env)
    try:
        marker = tmp_path / "orphan" / "iter_2" / "rollout" / "manifest.json"
        wait_until(lambda: marker.exists() or run.poll() is not None, 600, "iteration 2's rollout", interval=0.05)
        [forked] = [p for p in launcher.children() if "train" in " ".join(p.cmdline())]
        launcher.kill()
        launcher.wait(10)
        time.sleep(2)
        assert run.poll() is None and forked.is_running()  # the run goes on, and its command with it
        os.killpg(run.pid, signal.SIGINT)  # Ctrl-C still reaches the run
        code, out, err = _finish(run, 60)
        assert code == 1, err[-3000:]
        assert "its exit status is lost: waiting for it to end" in err, err[-3000:]
        # the run got the signal; it stops without its Prefect API (the launcher's, gone with it), within the
        # bounded time a stop has (areal_pipeline/shutdown.py)
        assert "SIGINT received: stopping the run's servers and trainer" in err, err[-3000:]
        assert not forked.is_running() or forked.status() == psutil.STATUS_ZOMBIE
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
        for process in launcher.children(recursive=True) if launcher.is_running() else []:
            process.kill()


def test_a_command_that_the_launcher_cannot_run_as_a_new_interpreter_would_starts_cold(launcher, tmp_path):
    before = _status(launcher)["runs_started"]
    bad = ["train", "--config", "configs/tiny_cpu.yaml", f"output_dir={tmp_path}", "no_such_key=1"]
    code, out, err = _finish(_command(*bad, env={**launcher, "OMP_NUM_THREADS": "3"}))
    assert code == 1 and "config error" in err, err
    assert ("started cold: environment variables read at import differ from the launcher's: OMP_NUM_THREADS"
            in err), err
    code, out, err = _finish(_command(*bad, env=launcher, prefix=("nice", "-n", "3")))
    assert code == 1 and "config error" in err, err
    assert "started cold: the priority (nice) of the command and of the launcher differ" in err, err
    code, out, err = _finish(_command(*bad, env={**launcher, "AREAL_WARM": "0"}))
    assert code == 1 and "config error" in err and "started cold" not in err, err
    assert _status(launcher)["runs_started"] == before


def test_a_changed_module_restarts_the_launcher_and_that_command_starts_cold(tmp_path):
    user_code = tmp_path / "user_code"
    user_code.mkdir()
    module = user_code / "warm_probe_reward.py"
    module.write_text("def reward(*args, **kwargs):\n    return 1.0\n")
    env = _start_launcher(tmp_path, "--preload", "warm_probe_reward",
                          env_extra={"PYTHONPATH": os.pathsep.join([str(user_code), str(REPO)])})
    try:
        first = _status(env)
        bad = ["train", "--config", "configs/tiny_cpu.yaml", f"output_dir={tmp_path}", "no_such_key=1"]
        code, _, err = _finish(_command(*bad, env=env))
        assert code == 1 and "started cold" not in err, err
        assert _status(env)["runs_started"] == 1
        module.write_text("def reward(*args, **kwargs):\n    return 0.0\n")
        later = time.time() + 5
        os.utime(module, (later, later))
        code, _, err = _finish(_command(*bad, env=env))
        assert code == 1 and "config error" in err, err
        assert f"started cold: {module} changed since the warm launcher imported it (it restarts)" in err, err
        # the same process, started afresh with the same arguments: it imports the module as it is now
        restarted = wait_until(lambda: (_status_or_none(env) or {}).get("started", first["started"]) != first["started"]
                               and _status_or_none(env), 120, "the launcher to restart")
        assert restarted["pid"] == first["pid"] and restarted["runs_started"] == 0
        code, _, err = _finish(_command(*bad, env=env))
        assert code == 1 and "started cold" not in err, err
        assert _status(env)["runs_started"] == 1
    finally:
        _stop_launcher(env)


def test_a_deployment_run_of_serve_is_a_fork_of_the_launcher_and_stops_with_serve(launcher, prefect_api,
                                                                                  tiny_model_dir, tmp_path):
    """`areal-pipeline serve`: Prefect's runner spawns each deployment run (multiprocessing), and the spawned process
    asks the launcher to run it as a fork; Ctrl-C to serve stops such a run and everything it started."""
    import asyncio

    from prefect.client.orchestration import get_client

    env = {**launcher, "PREFECT_API_URL": prefect_api}
    before = _status(launcher)["runs_started"]
    serve = cli("serve", "--config", "configs/tiny_cpu.yaml", "--iterations", "2",
                *fast_overrides(tmp_path, tiny_model_dir, run_id="served"), env=env, start_new_session=True)

    async def run_to_the_end(parameters: dict):
        async with get_client() as client:
            deployment = await wait_for_deployment(client, "train/train")
            run = await client.create_flow_run_from_deployment(deployment.id, parameters=parameters)
            for _ in range(3000):
                run = await client.read_flow_run(run.id)
                if run.state.is_final():
                    return run.state
                await asyncio.sleep(0.2)

    forked, started = None, []
    try:
        state = asyncio.run(run_to_the_end({}))
        runs_started = _status(launcher)["runs_started"]
        if not (state.is_completed() and runs_started == before + 1):
            stop_serve(serve)
            raise AssertionError(f"{state}, {runs_started - before} runs of the launcher: {serve.stdout.read()[:4000]}")
        lines = (tmp_path / "served" / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["iteration"] for line in lines] == [1, 2]

        async def start_long_run():
            async with get_client() as client:
                deployment = await wait_for_deployment(client, "train/train")
                await client.create_flow_run_from_deployment(deployment.id, parameters={"iterations": 50})

        asyncio.run(start_long_run())
        marker = tmp_path / "served" / "iter_4" / "rollout" / "manifest.json"
        wait_until(lambda: marker.exists(), 300, "the second run's first iteration", interval=0.05)
        launcher_pid = _status(launcher)["pid"]
        [forked] = [p for p in psutil.Process(launcher_pid).children() if "--multiprocessing-fork" in p.cmdline()[-1]]
        started = forked.children(recursive=True)
        assert any("inference.server" in " ".join(p.cmdline()) for p in started), [p.cmdline() for p in started]
    finally:
        sent = time.monotonic()
        stop_serve(serve)
    for process in [p for p in [forked, *started] if p is not None]:
        wait_until(lambda: not process.is_running() or process.status() == psutil.STATUS_ZOMBIE,
                   STOPPED_WITHIN_S - (time.monotonic() - sent) + 5, f"{process.pid} to exit")
    assert _status(launcher)["runs_started"] == before + 2


def test_serve_keeps_a_launcher_for_its_runs(prefect_api, tiny_model_dir, tmp_path):
    """AREAL_WARM=auto: `serve` starts a launcher, and starts another when that one is gone (killed here; ended by
    idleness the same), and its next deployment run is a fork of the new one."""
    import asyncio

    from prefect.client.orchestration import get_client

    env = {**os.environ, "AREAL_WARM_SOCKET": str(tmp_path / "warm.sock"), "PREFECT_HOME": str(tmp_path / "ph"),
           "PREFECT_API_URL": prefect_api, "AREAL_WARM_KEEP_SECONDS": "1"}
    for name in ("AREAL_WARM", "CI"):
        env.pop(name, None)
    serve = cli("serve", "--config", "configs/tiny_cpu.yaml", "--iterations", "1",
                *fast_overrides(tmp_path, tiny_model_dir, run_id="kept"), env=env, start_new_session=True)
    try:
        first = wait_until(lambda: _status_or_none(env), 300, "the launcher serve starts")
        _LAUNCHERS[env["AREAL_WARM_SOCKET"]] = first["pid"]
        launcher = psutil.Process(first["pid"])
        for process in [*launcher.children(recursive=True), launcher]:
            process.kill()
        launcher.wait(10)
        second = wait_until(lambda: (lambda s: s if s and s["pid"] != first["pid"] else None)(_status_or_none(env)),
                            300, "serve to start another launcher")
        _LAUNCHERS[env["AREAL_WARM_SOCKET"]] = second["pid"]

        async def run_to_the_end():
            async with get_client() as client:
                deployment = await wait_for_deployment(client, "train/train")
                run = await client.create_flow_run_from_deployment(deployment.id, parameters={"run_id": "kept"})
                for _ in range(3000):
                    run = await client.read_flow_run(run.id)
                    if run.state.is_final():
                        return run.state
                    await asyncio.sleep(0.2)

        assert asyncio.run(run_to_the_end()).is_completed()
        assert _status(env)["runs_started"] == 1
    finally:
        stop_serve(serve)
        if env["AREAL_WARM_SOCKET"] in _LAUNCHERS:
            _stop_launcher(env)


def test_a_cold_command_starts_a_launcher_for_the_next_ones_once(tiny_model_dir, tmp_path):
    """AREAL_WARM=auto (the default): a cold command that ran to its end leaves a launcher behind, in the
    background; a command that ends while it still imports starts no second one; the next command is its fork."""
    env = {**os.environ, "AREAL_WARM_SOCKET": str(tmp_path / "warm.sock"), "PREFECT_HOME": str(tmp_path / "ph")}
    for name in ("AREAL_WARM", "CI", "PREFECT_API_URL"):
        env.pop(name, None)
    pids = []
    try:
        for run_id in ("first", "second"):  # the second begins before the launcher can have imported anything
            code, out, err = _finish(_command("train", "--config", "configs/tiny_cpu.yaml",
                                              *fast_overrides(tmp_path, tiny_model_dir, run_id=run_id, iterations=1),
                                              env=env))
            assert code == 0, out[-3000:] + err[-3000:]
            pids += [int(line.split("(pid ")[1].split(")")[0]) for line in err.splitlines()
                     if "started a warm launcher in the background" in line]
        assert len(pids) == 1, err
        _LAUNCHERS[env["AREAL_WARM_SOCKET"]] = pids[0]
        status = wait_until(lambda: _status_or_none(env), 300, "the launcher to answer")
        assert status["pid"] == pids[0] and status["idle_minutes"] == 60
        code, out, err = _finish(_command("train", "--config", "configs/tiny_cpu.yaml",
                                          *fast_overrides(tmp_path, tiny_model_dir, run_id="third", iterations=1),
                                          env=env))
        assert code == 0, out[-3000:] + err[-3000:]
        assert "started cold" not in err and "started a warm launcher" not in err, err
        assert _status(env)["runs_started"] == 1
    finally:
        if pids:
            _stop_launcher(env)


def test_each_python_environment_has_its_own_launcher_socket(monkeypatch, tmp_path):
    from flows import warm

    monkeypatch.delenv("AREAL_WARM_SOCKET", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    mine = warm.socket_path()
    assert mine.parent == tmp_path and mine.name.startswith(f"areal-pipeline-warm-{os.getuid()}-")
    monkeypatch.setattr(sys, "executable", str(Path(sys.executable).with_name("python3.11")))  # the same directory
    assert warm.socket_path() == mine
    monkeypatch.setattr(sys, "executable", str(tmp_path / "other-venv" / "bin" / "python"))
    assert warm.socket_path() != mine


def test_no_launcher_is_started_under_ci_or_where_areal_warm_says_so(monkeypatch, tmp_path):
    from flows import warm

    monkeypatch.setenv("AREAL_WARM_SOCKET", str(tmp_path / "warm.sock"))
    for mode, ci in (("auto", "true"), ("1", ""), ("0", "")):
        monkeypatch.setenv("AREAL_WARM", mode)
        monkeypatch.setenv("CI", ci)
        assert warm.start_for_next_commands(dict(os.environ)) is None
    assert not (tmp_path / "warm.sock.lock").exists()
    monkeypatch.setenv("AREAL_WARM", "yes")
    with pytest.raises(SystemExit, match="AREAL_WARM='yes' is not one of: auto"):
        warm.warm_mode()


_HANDLERS = """
import json, logging
def handlers():
    loggers = {"": logging.getLogger(), **logging.Logger.manager.loggerDict}
    return {name: sorted(type(h).__name__ for h in getattr(logger, "handlers", ())) for name, logger in loggers.items()
            if getattr(logger, "handlers", None)}
"""


def test_logging_in_a_fork_of_the_launcher_is_set_up_as_a_new_interpreter_sets_it_up():
    """The command configures the root logger before it imports Prefect, the launcher had Prefect configure it
    at import: a fork undoes that and redoes it after the command's set-up (each Prefect handler once: twice,
    the library's records reached the run logs twice)."""
    cold = _HANDLERS + """
logging.basicConfig(level="INFO")
import flows.train
print(json.dumps(handlers()))
"""
    forked = _HANDLERS + """
import flows.train
from flows import warm
warm._undo_prefect_logging()
logging.basicConfig(level="INFO")
warm.redo_prefect_logging()
print(json.dumps(handlers()))
"""
    seen = []
    for script in (cold, forked):
        done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        seen.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert seen[0] == seen[1]
    assert seen[0]["areal_pipeline"] == ["APILogHandler"] and seen[0][""] == ["StreamHandler"], seen[0]
