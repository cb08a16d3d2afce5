"""A real `prefect server start` on loopback for the tests that need what a user's own server runs (workers,
the events pipeline, automations), as opposed to the project's temporary API server."""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import sqlite3
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from areal_pipeline.utils import find_free_port

PREFECT = str(Path(sys.executable).parent / "prefect")

# A user's server runs Prefect's defaults; importing `flows` in this process set a few of them off (see
# flows/__init__.py), and the server would inherit that from os.environ.
SERVER_ENV = {
    "PREFECT_SERVER_SERVICES_TRIGGERS_ENABLED": "true",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_ENABLED": "true",
    "PREFECT_SERVER_EVENTS_STREAM_OUT_ENABLED": "true",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "DO_NOT_TRACK": "1",
    "PREFECT_UI_ENABLED": "false",
}


def server_env(home: Path) -> dict[str, str]:
    env = {**os.environ, **SERVER_ENV, "PREFECT_HOME": str(home)}
    env.pop("PREFECT_API_URL", None)
    return env


def seed_database(home: Path) -> None:
    """Give the server of `home` (its PREFECT_HOME) a database already at the schema's head, as a server started
    before leaves it: a copy of one `prefect server database upgrade` made once for the test session (shared by
    its workers). A server's first start on an empty file runs every migration, seconds of CPU each time; the
    first-start path stays covered by the servers that start on an empty home (the session's `prefect_api`, the
    temporary API servers). Nothing where `home` has a database already."""
    from conftest import SESSION_TEMP

    target = home / "prefect.db"
    if target.exists():
        return
    home.mkdir(parents=True, exist_ok=True)
    template_home = SESSION_TEMP[0] / "prefect-db-template"
    template_home.mkdir(exist_ok=True)
    template = template_home / "prefect.db"
    with open(template_home / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another worker building it: wait for its build
        if not (template_home / "done").exists():
            subprocess.run([PREFECT, "--no-prompt", "server", "database", "upgrade", "-y"], env=server_env(template_home),
                           check=True, capture_output=True, timeout=300, stdin=subprocess.DEVNULL)
            (template_home / "done").touch()
        source, copy = sqlite3.connect(template), sqlite3.connect(target)
        try:
            source.backup(copy)  # a consistent copy whatever the journal mode
        finally:
            source.close()
            copy.close()


@contextlib.contextmanager
def prefect_server(home: Path, timeout: float = 180) -> Iterator[str]:
    """`prefect server start` (SQLite under `home`, from `seed_database`) for the block; yields its API URL."""
    seed_database(home)
    port = find_free_port()
    log = open(home / "server.log", "w")
    server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=server_env(home), stdout=log, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}/api"
    try:
        wait_for_api(server, url, home / "server.log", timeout)
        yield url
    finally:
        drain_prefect_workers()
        stop_group(server)
        log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A `prefect server start` of the test module's own (a module that imports this fixture), its API URL."""
    with prefect_server(tmp_path_factory.mktemp("prefect-server")) as url:
        yield url


def drain_prefect_workers(timeout: float = 30) -> None:
    """Send what this process queued for Prefect APIs (run logs, events) and stop the workers that send them,
    within `timeout`, before a server they send to stops: a worker left with a gone server retries, and Prefect's
    test harness waits for every events worker at its exit, without a deadline. New ones start at the next log or
    event."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=timeout)


def wait_for_api(server: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    """Until the API at `url` answers /health (RuntimeError quoting its `log` if `server` exits first)."""
    deadline = time.monotonic() + timeout
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"prefect server start exited ({server.returncode}): {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"prefect server start did not answer within {timeout} s")
        time.sleep(0.3)


def stop_group(process: subprocess.Popen, timeout: float = 30) -> None:
    """SIGINT to the process group (as Ctrl-C), then, if it is still there after `timeout`, SIGABRT to the process
    (with PYTHONFAULTHANDLER set, as `client_env` sets it, its threads' stacks go to its output: where it hung) and
    SIGKILL to the group."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGINT)
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):  # the group is gone with it
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout)  # a SIGKILLed process is gone at once: a longer wait is a kernel problem, raised
    except ProcessLookupError:
        pass


def client_env(api_url: str, home: Path) -> dict[str, str]:
    """The environment of a command run against the server (CLI, worker, a train run)."""
    return {**os.environ, "PREFECT_API_URL": api_url, "PREFECT_HOME": str(home), "PYTHONFAULTHANDLER": "1"}


def no_postgres() -> str:
    """Why the project's standing server cannot run here ("" where it can)."""
    from areal_pipeline.prefect_server import PrefectServerError, postgres_binaries

    try:
        postgres_binaries()
    except PrefectServerError as e:
        return str(e)
    return ""


@contextlib.contextmanager
def standing_postgres_server(cli, directory: Path, env: dict, *start_args: str) -> Iterator[tuple[str, str]]:
    """`areal-pipeline prefect-server start` (PostgreSQL and a Prefect server) in `directory`, run by `cli(*args,
    env=)` (its stdout; it fails the test on a non-zero exit), with `start_args`: (the API's URL, what `start`
    printed). At the end `prefect-server stop`, checked to have stopped both, and whatever a failed test left
    running is stopped."""
    import psutil

    from areal_pipeline.prefect_server import LocalPrefectServer

    port, pg_port = find_free_port(), find_free_port()
    try:
        out = cli("prefect-server", "start", "--dir", str(directory), "--port", str(port), "--pg-port", str(pg_port),
                  *start_args, env=env)
        yield f"http://127.0.0.1:{port}/api", out
        if "prefect" in sys.modules:
            drain_prefect_workers()  # what this process sent there, before the server goes
        out = cli("prefect-server", "stop", "--dir", str(directory), env=env)
        assert "Prefect server" in out and "PostgreSQL stopped" in out, out
        assert "stopped" in cli("prefect-server", "status", "--dir", str(directory), env=env)
    finally:
        server = LocalPrefectServer(directory)
        pid = server.server_pid()
        server.stop()
        assert pid is None or not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert not (directory / "postgres" / "data" / "postmaster.pid").exists()
