"""The Prefect API going away under a run: a standing `prefect server start` that the test SIGKILLs mid-run and
starts again on the same port and database; real train runs (CLI subprocesses), real processes throughout.

Past the grace (`--api-grace`) the run stops at its next node and exits 75 saying what is finished; rerun once
the API is back, it continues to the same weights as a run that was never interrupted. An API back within the
grace changes nothing."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from _prefect_server import (PREFECT, client_env, drain_prefect_workers, seed_database, server_env, stop_group,
                             wait_for_api)
from areal_pipeline.forkserver import processes_of
from areal_pipeline.shutdown import FORCED_EXIT_AFTER_S
from areal_pipeline.utils import find_free_port
from test_flows import cli, fast_overrides, final_weights, wait_until

GRACE_S = 5
ONE_NODE_S = 60  # the longest a node of the tiny run takes on a loaded machine, with slack


class StandingAPI:
    """`prefect server start` on a fixed port over one database, which can be killed and started again."""

    def __init__(self, home: Path):
        self.home, self.port = home, find_free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.process = None
        seed_database(home)

    def start(self, timeout: float = 180) -> None:
        with open(self.home / "server.log", "a") as log:
            self.process = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port",
                                             str(self.port)], env=server_env(self.home), stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        wait_for_api(self.process, self.url, self.home / "server.log", timeout)

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)


@pytest.fixture
def api(tmp_path) -> Iterator[StandingAPI]:
    standing = StandingAPI(tmp_path / "prefect-home")
    standing.start()
    try:
        yield standing
    finally:
        drain_prefect_workers(timeout=10)  # what this process sent there (the server may be the killed one)
        if standing.process is not None:
            stop_group(standing.process)


def _train(tmp_path: Path, model_dir: Path, run_id: str, env: dict, *extra: str) -> subprocess.Popen:
    return cli("train", "--config", "configs/tiny_cpu.yaml", *extra,
               *fast_overrides(tmp_path, model_dir, run_id=run_id, iterations=4), "save_freq=4",
               env=env, start_new_session=True)


def _finish(run: subprocess.Popen, timeout: float = 900) -> str:
    try:
        out, _ = run.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        out, _ = run.communicate(timeout=30)
        raise AssertionError(f"still running after {timeout} s:\n{out[-3000:]}")
    return out


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _kill_api_at_iteration_2(api: "StandingAPI", run: subprocess.Popen, run_dir: Path) -> None:
    """SIGKILL the API once the run wrote iteration 2's rollout (the run still going)."""
    marker = run_dir / "iter_2" / "rollout" / "manifest.json"
    wait_until(lambda: marker.exists() or run.poll() is not None, 600, "iteration 2's rollout", interval=0.05)
    assert run.poll() is None, run.stdout.read()[-3000:]
    api.kill()


def _started_iterations(run_dir: Path) -> list[int]:
    """The iterations whose directory exists: their rollout began."""
    return [int(p.name.split("_")[1]) for p in run_dir.glob("iter_*") if p.name.split("_")[1].isdigit()] or [0]


def _iterations(run_dir: Path) -> list[int]:
    return [json.loads(line)["iteration"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_the_api_killed_mid_run_stops_it_with_75_and_the_rerun_continues_to_the_same_weights(
        api, tiny_model_dir, tmp_path):
    env = client_env(api.url, api.home)
    reference = _train(tmp_path, tiny_model_dir, "ref", env)
    out = _finish(reference)
    assert reference.returncode == 0, out[-3000:]

    run = _train(tmp_path, tiny_model_dir, "outage", env, "--api-grace", str(GRACE_S))
    _kill_api_at_iteration_2(api, run, tmp_path / "outage")
    started_at_kill = _started_iterations(tmp_path / "outage")
    out = _finish(run, timeout=GRACE_S + ONE_NODE_S + 60)  # a deadline, not a measurement
    assert run.returncode == 75, out[-3000:]
    assert "has not answered for" in out and "rerun the same command when the API is back" in out, out[-3000:]
    # past the grace no further node started: at most the iteration after those begun when the API died
    assert max(_started_iterations(tmp_path / "outage")) <= max(started_at_kill) + 1, out[-3000:]
    # what the message says is finished is what is on disk: iteration 1 at least (its rollout came before the kill)
    finished = sorted(int(p.parent.name.split("_")[1]) for p in (tmp_path / "outage").glob("iter_*/metrics.json"))
    assert finished and f"iterations 1..{finished[-1]} are finished on disk" in out, (finished, out[-3000:])
    wait_until(lambda: processes_of(run.pid) == [], 60, "the run's processes to exit")

    api.start()
    rerun = _train(tmp_path, tiny_model_dir, "outage", env)
    out = _finish(rerun)
    assert rerun.returncode == 0, out[-3000:]
    assert "continuing at" in out, out[-3000:]
    assert _iterations(tmp_path / "outage") == [1, 2, 3, 4], out[-3000:]
    assert _same_weights(final_weights(tmp_path / "outage", 4), final_weights(tmp_path / "ref", 4))


def test_an_api_back_within_the_grace_changes_nothing(api, tiny_model_dir, tmp_path):
    """The API killed mid-run and started again: the run's watch sees it fail and answer again (both said on the
    terminal), and the run goes on to the end as if nothing happened."""
    env = client_env(api.url, api.home)
    run = _train(tmp_path, tiny_model_dir, "blip", env, "--api-grace", "300")
    _kill_api_at_iteration_2(api, run, tmp_path / "blip")
    log = tmp_path / "blip" / "logs" / "train.log"
    wait_until(lambda: "does not answer" in log.read_text() or run.poll() is not None, 120,
               "the run's watch to see the API gone")  # the event, not a sleep, decides when it comes back
    api.start()
    out = _finish(run)
    assert run.returncode == 0, out[-3000:]
    assert _iterations(tmp_path / "blip") == [1, 2, 3, 4], out[-3000:]
    # the watch noticed the outage and the recovery (a run without a watch says neither)
    gone, back = out.find("does not answer"), out.find("answers again")
    assert 0 <= gone < back, out[-3000:]


def test_a_bad_api_grace_is_refused_before_anything_starts(tmp_path):
    run = cli("train", "--api-grace", "0", "--config", "configs/tiny_cpu.yaml", env=dict(os.environ))
    out = _finish(run, timeout=60)
    assert run.returncode == 2 and "--api-grace: '0': must be a positive number of seconds" in out, out[-2000:]
    from flows.control import api_grace

    with contextlib.ExitStack() as stack:
        stack.callback(os.environ.pop, "AREAL_API_GRACE_S", None)
        os.environ["AREAL_API_GRACE_S"] = "soon"
        with pytest.raises(ValueError, match="AREAL_API_GRACE_S='soon': the API grace must be a positive number"):
            api_grace()
        os.environ["AREAL_API_GRACE_S"] = "7.5"
        assert api_grace() == 7.5


def test_sigterm_ends_a_run_within_seconds_with_the_api_gone(api, tiny_model_dir, tmp_path):
    """Prefect's SIGTERM handler, installed for the whole flow run, would report the crash to the dead API first
    (minutes of retries): the project's stop still starts at the signal, and the forced exit ends the process."""
    env = client_env(api.url, api.home)
    run = _train(tmp_path, tiny_model_dir, "term", env, "--api-grace", "600")
    _kill_api_at_iteration_2(api, run, tmp_path / "term")
    time.sleep(1)
    run.send_signal(signal.SIGTERM)
    # a deadline several times the forced exit's, far below the dead API's minutes of retries: not a measurement
    out = _finish(run, timeout=6 * FORCED_EXIT_AFTER_S)
    assert run.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "SIGTERM received: stopping the run's servers and trainer" in out, out[-3000:]  # at the signal
    wait_until(lambda: processes_of(run.pid) == [], 60, "the run's processes to exit")


def test_sigterm_to_serve_with_the_api_gone_ends_it_its_sweep_and_the_sweep_s_run(
        api, tiny_model_dir, tmp_path):
    """`serve` runs a sweep deployment run, which runs a train run: the API dies, then `serve` gets SIGTERM. The
    runner's shutdown and each run's crash report would wait on the dead API (minutes of retries); all of them are
    gone within a deadline a few times their forced exit's."""
    import asyncio

    import psutil
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from test_flows import wait_for_deployment

    env = client_env(api.url, api.home)
    import sys

    from test_flows import REPO

    log = tmp_path / "serve.log"
    serve = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--config", "configs/tiny_cpu.yaml",
                              "--iterations", "50", *fast_overrides(tmp_path, tiny_model_dir, run_id="served",
                                                                    iterations=50)],
                             cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                             start_new_session=True)

    async def start_a_sweep():
        async with get_client() as client:
            deployment = await wait_for_deployment(client, "sweep/sweep", run_id="served")
            axes = [a for a in deployment.parameters["axes"] if not a.startswith("trainer.optimizer.lr=")]
            await client.create_flow_run_from_deployment(deployment.id, parameters={
                "axes": [*axes, "trainer.optimizer.lr=1e-3"]})

    started: list[psutil.Process] = []
    try:
        with temporary_settings(updates={PREFECT_API_URL: api.url}):
            asyncio.run(start_a_sweep())
        marker = tmp_path / "served" / "iter_2" / "rollout" / "manifest.json"  # one value: the run id unchanged
        wait_until(lambda: marker.exists() or serve.poll() is not None, 300, "the sweep's run's second iteration",
                   interval=0.05)
        assert serve.poll() is None, log.read_text()[-3000:]
        started = psutil.Process(serve.pid).children(recursive=True)
        commands = " | ".join(" ".join(p.cmdline()) for p in started)
        assert "prefect.engine" in commands and "child_main" in commands and "trainer_server" in commands, commands
        api.kill()
        time.sleep(1)
        serve.send_signal(signal.SIGTERM)

        def gone(process: psutil.Process) -> bool:
            try:
                return process.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        try:
            wait_until(lambda: serve.poll() is not None and all(gone(p) for p in started), 5 * FORCED_EXIT_AFTER_S,
                       "serve, its sweep, the sweep's run and its services to exit")
        except AssertionError:
            raise AssertionError(log.read_text()[-3000:])
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
        for process in started:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
