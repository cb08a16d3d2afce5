"""The production set-up, all real processes on loopback: PostgreSQL (initdb / pg_ctl / postgres from PATH) and
`prefect server start` on it, both started and stopped by `areal-pipeline prefect-server`; against it a train
run from the command line, a deployment run triggered through the API (served by `areal-pipeline serve`) and a
sweep of 3 concurrent runs, all completing, each run's flow runs and artifacts read back from PostgreSQL."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import psutil
import pytest
import yaml

from _prefect_server import SERVER_ENV, client_env, no_postgres, standing_postgres_server
from areal_pipeline.prefect_server import SERVER_DEFAULTS, LocalPrefectServer, server_env
from flows.artifacts import artifact_key
from areal_pipeline.forkserver import processes_of
from test_flows import (REPO, cli, fast_overrides, serve_cli, stop_serve, wait_for_deployment,
                        wait_until)



pytestmark = pytest.mark.skipif(bool(no_postgres()), reason=f"no PostgreSQL here: {no_postgres()}")

AREAL = str(Path(sys.executable).parent / "areal-pipeline")
ITERATIONS = 2


def _command(*args: str, env: dict, timeout: float = 240) -> str:
    done = subprocess.run([AREAL, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"areal-pipeline {' '.join(args)}:\n{(done.stdout + done.stderr)[-4000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def pg_server():
    """`areal-pipeline prefect-server start` in a fresh directory; stopped (and checked stopped) at the end."""
    # /tmp, not pytest's tmp_path: a short path for PostgreSQL's unix socket, in a directory the postgres user can
    # enter where the tests run as root
    top = Path(tempfile.mkdtemp(prefix="areal-pg-", dir="/tmp"))
    top.chmod(0o755)
    directory = top / "server"
    # a user's server runs Prefect's defaults, not what importing `flows` set in this process's environment
    env = {k: v for k, v in os.environ.items()
           if k not in SERVER_DEFAULTS and k not in ("PREFECT_API_URL", "PREFECT_UI_API_URL", "PREFECT_SERVER_UI_API_URL")}
    env.update(SERVER_ENV)
    try:
        with standing_postgres_server(_command, directory, env) as (url, out):
            assert out.strip().splitlines()[-1] == f"export PREFECT_API_URL={url}", out
            yield url, directory, env
    finally:
        shutil.rmtree(top, ignore_errors=True)


async def _postgres_rows(server_dir: Path, sql: str, *args):
    """Rows straight from the server's PostgreSQL database: what the Prefect API recorded is really there."""
    import asyncpg

    state = json.loads((server_dir / "server.json").read_text())
    password = (server_dir / "db-password").read_text().strip()
    connection = await asyncpg.connect(host="127.0.0.1", port=state["pg_port"], user="postgres",
                                       password=password, database="prefect")
    try:
        return await connection.fetch(sql, *args)
    finally:
        await connection.close()


async def _flow_run(client, name: str):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    runs = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name])))
    assert len(runs) == 1, (name, runs)
    return runs[0]


def assert_recorded(api_url: str, server_dir: Path, run_id: str) -> None:
    """The run's train flow run and its iteration runs completed, its artifacts are there: through the API and
    in PostgreSQL's tables."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.settings import PREFECT_API_URL, temporary_settings

    async def read():
        async with get_client() as client:
            iterations = [await _flow_run(client, f"{run_id}/iter-{k}") for k in range(1, ITERATIONS + 1)]
            train_ids = {await _parent_flow_run_id(client, run) for run in iterations}
            artifacts = await client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(
                any_=[artifact_key(run_id, "metrics"), artifact_key(run_id, "reward-curve")])))
            return iterations, train_ids, artifacts

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        iterations, train_ids, artifacts = asyncio.run(read())
    assert all(run.state.is_completed() for run in iterations), [(r.name, r.state) for r in iterations]
    assert len(train_ids) == 1, train_ids
    assert {a.key for a in artifacts} == {artifact_key(run_id, "metrics"), artifact_key(run_id, "reward-curve")}
    rows = asyncio.run(_postgres_rows(
        server_dir, "SELECT f.name, r.state_type::text AS state FROM flow_run r JOIN flow f ON f.id = r.flow_id "
                    "WHERE r.id = $1 OR r.name LIKE $2", next(iter(train_ids)), f"{run_id}/iter-%"))
    assert sorted((row["name"], row["state"]) for row in rows) == (
        [("iteration", "COMPLETED")] * ITERATIONS + [("train", "COMPLETED")]), rows
    metrics = asyncio.run(_postgres_rows(server_dir, "SELECT count(*) AS n FROM artifact WHERE key = $1",
                                         artifact_key(run_id, "metrics")))
    assert metrics[0]["n"] == 1  # one table a train run, updated in place: a row per iteration (0: the initial eval)
    (table,) = [a for a in artifacts if a.key == artifact_key(run_id, "metrics")]
    assert [row["iteration"] for row in json.loads(table.data) if row["iteration"]] == list(range(1, ITERATIONS + 1))


async def _parent_flow_run_id(client, flow_run):
    task_run = await client.read_task_run(flow_run.parent_task_run_id)
    return task_run.flow_run_id


def test_the_server_listens_on_loopback_only_and_runs_on_postgres(pg_server):
    url, directory, env = pg_server
    status = _command("prefect-server", "status", "--dir", str(directory), env=env)
    assert "postgres:       running" in status and "prefect_server: healthy" in status, status
    server_pid = LocalPrefectServer(directory).server_pid()
    postmaster = int((directory / "postgres" / "data" / "postmaster.pid").read_text().split()[0])
    for pid in (server_pid, postmaster):
        listening = [c.laddr for c in psutil.Process(pid).net_connections("inet") if c.status == psutil.CONN_LISTEN]
        assert listening and all(addr.ip == "127.0.0.1" for addr in listening), (pid, listening)
    tables = asyncio.run(_postgres_rows(directory, "SELECT count(*) AS n FROM information_schema.tables "
                                                   "WHERE table_name IN ('flow_run', 'task_run', 'artifact')"))
    assert tables[0]["n"] == 3  # Prefect migrated its schema into PostgreSQL
    # task-run states recorded in batches (a transaction each cost the run's cores: bench/prefect_backends.py)
    environ_of_server = psutil.Process(server_pid).environ()
    assert {k: environ_of_server.get(k) for k in SERVER_DEFAULTS} == SERVER_DEFAULTS


def test_the_ui_calls_the_api_on_the_port_it_serves(pg_server):
    """The UI's pages read the API's URL from the server's /ui-settings: on a port other than Prefect's default it
    names that port, not 4200's."""
    url, _, _ = pg_server
    assert not url.startswith("http://127.0.0.1:4200/")
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(
            url.removesuffix("/api") + "/ui-settings", timeout=30) as reply:
        settings = json.loads(reply.read())
    assert settings["api_url"] == url, settings


def test_a_ui_api_url_the_user_set_wins():
    environ = {"PATH": "/usr/bin", "PREFECT_API_URL": "http://elsewhere:4200/api"}
    env = server_env(environ, "http://127.0.0.1:4299/api")
    assert env["PREFECT_UI_API_URL"] == "http://127.0.0.1:4299/api" and "PREFECT_API_URL" not in env
    for name in ("PREFECT_UI_API_URL", "PREFECT_SERVER_UI_API_URL"):
        env = server_env({**environ, name: "https://prefect.example.org/api"}, "http://127.0.0.1:4299/api")
        assert env.get("PREFECT_UI_API_URL", env.get("PREFECT_SERVER_UI_API_URL")) == "https://prefect.example.org/api"
        assert env[name] == "https://prefect.example.org/api"


def test_a_train_run_and_a_deployment_run_complete(pg_server, tiny_model_dir, tmp_path):
    """`areal-pipeline train` and a deployment run (created through the API, as the UI's Run button does, and run
    by `areal-pipeline serve`) at the same time."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    url, directory, _ = pg_server
    env = client_env(url, tmp_path / "prefect-home")
    train = cli("train", "--config", "configs/tiny_cpu.yaml",
                *fast_overrides(tmp_path, tiny_model_dir, run_id="pg-train", iterations=ITERATIONS), env=env,
                start_new_session=True)
    serve = serve_cli(tmp_path / "serve.log", "--config", "configs/tiny_cpu.yaml",
                      *fast_overrides(tmp_path, tiny_model_dir, run_id="pg-deployed", iterations=ITERATIONS), env=env)
    try:
        async def run_deployment():
            async with get_client() as client:
                deployment = await wait_for_deployment(client, "train/train", run_id="pg-deployed")
                flow_run = await client.create_flow_run_from_deployment(deployment.id)
                for _ in range(1500):
                    flow_run = await client.read_flow_run(flow_run.id)
                    if flow_run.state.is_final():
                        return flow_run
                    await asyncio.sleep(0.2)
                raise AssertionError(f"the deployment run did not finish: {flow_run.state}")

        with temporary_settings(updates={PREFECT_API_URL: url}):
            deployed = asyncio.run(run_deployment())
        assert deployed.state.is_completed(), deployed.state
        out, _ = train.communicate(timeout=300)
        assert train.returncode == 0, out[-4000:]
    finally:
        stop_serve(serve)
        if train.poll() is None:
            stop_serve(train)
    assert_recorded(url, directory, "pg-train")
    assert_recorded(url, directory, "pg-deployed")


def test_a_sweep_of_three_concurrent_runs(pg_server, tiny_model_dir, tmp_path):
    """`areal-pipeline sweep --max-parallel 3` over three learning rates: three train flow runs at once, each a
    child of the sweep's flow run, and the table of their figures."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    url, directory, _ = pg_server
    env = client_env(url, tmp_path / "prefect-home")
    fixed = [o for o in fast_overrides(tmp_path, tiny_model_dir, iterations=ITERATIONS)
             if not o.startswith(("run_id=", "trainer.optimizer.lr="))]
    sweep = cli("sweep", "--config", "configs/tiny_cpu.yaml", "--run-id", "pgs", "--max-parallel", "3", *fixed,
                "trainer.optimizer.lr=1e-3,2e-3,3e-3", env=env, start_new_session=True)
    try:
        out, _ = sweep.communicate(timeout=300)
    finally:
        if sweep.poll() is None:
            stop_serve(sweep)
    assert sweep.returncode == 0, out[-4000:]
    run_ids = ["pgs-lr=1e-3", "pgs-lr=2e-3", "pgs-lr=3e-3"]
    table = out[out.index("run "):].splitlines()
    assert [line.split()[:3] for line in table[2:5]] == [[r, "Completed", str(ITERATIONS)] for r in run_ids], out

    async def read():
        async with get_client() as client:
            sweep_run = await _flow_run(client, "sweep/pgs")
            children = await client.read_flow_runs(flow_run_filter=FlowRunFilter(
                parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[sweep_run.id])))
            return sweep_run, children

    with temporary_settings(updates={PREFECT_API_URL: url}):
        sweep_run, children = asyncio.run(read())
    assert sweep_run.state.is_completed(), sweep_run.state
    trains = sorted((run for run in children if run.name in run_ids), key=lambda run: run.name)
    assert [run.name for run in trains] == run_ids and all(run.state.is_completed() for run in trains)
    # really concurrent: every run started before any of them ended
    assert max(run.start_time for run in trains) < min(run.end_time for run in trains), [
        (run.name, run.start_time, run.end_time) for run in trains]
    for run_id in run_ids:
        assert_recorded(url, directory, run_id)
        config = yaml.safe_load((tmp_path / run_id / "config.yaml").read_text())
        assert config["trainer"]["optimizer"]["lr"] == float(run_id.split("=")[1])
    wait_until(lambda: not processes_of(sweep.pid), 30, "the sweep's runs to exit")
