"""Prefect's basic auth on the standing server, all real processes on loopback: `areal-pipeline prefect-server start
--auth-file` (PostgreSQL, as test_prefect_postgres.py) gives the server its auth string by environment alone; a flow
run with the right PREFECT_API_AUTH_STRING (set, or read from AREAL_PIPELINE_PREFECT_AUTH_FILE) completes; with a
wrong one or none the project's command fails within seconds, naming PREFECT_API_AUTH_STRING; the string is on no
command line, in no output, log or file of the server's directory; an auth file others may read is refused."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from _prefect_server import SERVER_ENV, client_env, no_postgres, standing_postgres_server
from areal_pipeline.prefect_auth import (AUTH_FILE_ENV, CLIENT_AUTH_ENV, SERVER_AUTH_ENV, PrefectAuthError,
                                        api_answers, apply_prefect_auth_file)
from areal_pipeline.prefect_server import SERVER_DEFAULTS, LocalPrefectServer
from areal_pipeline.utils import find_free_port



pytestmark = [pytest.mark.skipif(bool(no_postgres()), reason=f"no PostgreSQL here: {no_postgres()}"),
              pytest.mark.timeout(300)]  # the first test's includes the server's start (initdb, Prefect's tables)

REPO = Path(__file__).resolve().parents[1]
AREAL = str(Path(sys.executable).parent / "areal-pipeline")
AUTH = f"areal:{secrets.token_urlsafe(18)}"  # this module's; no process may show it
WRONG = f"areal:{secrets.token_urlsafe(18)}"
FAIL_FAST_S = 60  # a refused command exits within this (it imports the project first: seconds on 2 loaded cores)
AUTH_VARS = (SERVER_AUTH_ENV, CLIENT_AUTH_ENV, AUTH_FILE_ENV)


def _run(*args: str, env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([AREAL, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _ok(*args: str, env: dict, timeout: float = 240) -> str:
    done = _run(*args, env=env, timeout=timeout)
    assert done.returncode == 0, f"areal-pipeline {' '.join(args)}:\n{(done.stdout + done.stderr)[-4000:]}"
    assert AUTH not in done.stdout + done.stderr
    return done.stdout


def _write_secret(path: Path, text: str, mode: int = 0o600) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    path.chmod(mode)  # whatever the umask
    return path


def _server_env() -> dict:
    """A user's server environment: Prefect's defaults (not what importing `flows` set here), no credential."""
    env = {k: v for k, v in os.environ.items()
           if k not in SERVER_DEFAULTS and k not in AUTH_VARS
           and k not in ("PREFECT_API_URL", "PREFECT_UI_API_URL", "PREFECT_SERVER_UI_API_URL")}
    env.update(SERVER_ENV)
    return env


@pytest.fixture(scope="module")
def auth_server():
    """`areal-pipeline prefect-server start --auth-file` in a fresh directory (one server for the module); stopped
    by `prefect-server stop` at the end, and checked stopped."""
    # /tmp: a short path for PostgreSQL's socket, in a directory the postgres user can enter where tests run as root
    top = Path(tempfile.mkdtemp(prefix="areal-pgauth-", dir="/tmp"))
    top.chmod(0o755)
    directory = top / "server"
    auth_file = _write_secret(top / "prefect-auth", AUTH)
    env = _server_env()
    try:
        started = time.monotonic()
        with standing_postgres_server(_ok, directory, env, "--auth-file", str(auth_file)) as (url, out):
            print(f"prefect-server start with auth: {time.monotonic() - started:.1f} s")
            assert out.strip().splitlines()[-2:] == [f"export PREFECT_API_URL={url}",
                                                     f"export {AUTH_FILE_ENV}={auth_file}"], out
            yield {"url": url, "dir": directory, "env": env, "auth_file": auth_file, "top": top, "start_output": out}
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _client(server: dict, home: Path, credential: str) -> dict:
    """A client's environment: the API's URL, and `credential`: "env" (PREFECT_API_AUTH_STRING, the right one),
    "file" (AREAL_PIPELINE_PREFECT_AUTH_FILE alone), "wrong" or "none"."""
    env = {k: v for k, v in client_env(server["url"], home).items() if k not in AUTH_VARS}
    if credential == "env":
        env[CLIENT_AUTH_ENV] = AUTH
    elif credential == "file":
        env[AUTH_FILE_ENV] = str(server["auth_file"])
    elif credential == "wrong":
        env[CLIENT_AUTH_ENV] = WRONG
    return env


def test_the_auth_string_reaches_the_server_by_environment_alone(auth_server):
    """Not on any command line (ps, /proc/PID/cmdline) of the server's processes, not in what `start` printed, not
    in server.json, the server's log or any file of its PREFECT_HOME; in the server's environment, which only its
    user (and root) may read; and the API refuses a call without it."""
    directory = auth_server["dir"]
    pid = LocalPrefectServer(directory).server_pid()
    assert pid is not None
    server = psutil.Process(pid)
    processes = [server, *server.children(recursive=True)]
    for process in processes:
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes()
        assert AUTH.encode() not in cmdline and b"prefect-auth" not in cmdline, cmdline
    assert server.environ().get(SERVER_AUTH_ENV) == AUTH
    assert AUTH_FILE_ENV not in server.environ()
    assert AUTH not in auth_server["start_output"]
    written = [directory / "server.json", directory / "prefect-server.log",
               *(p for p in (directory / "prefect").rglob("*") if p.is_file())]
    for path in written:
        assert AUTH.encode() not in path.read_bytes(), path
    # /health answers anyone (as for a load balancer's probe); the API does not
    assert api_answers(auth_server["url"], None) == 401
    assert api_answers(auth_server["url"], WRONG) == 401
    assert api_answers(auth_server["url"], AUTH) == 200


FLOW = textwrap.dedent("""
    import sys
    from areal_pipeline.prefect_auth import apply_prefect_auth_file
    apply_prefect_auth_file()  # before Prefect reads its settings, as the command line does
    from prefect import flow, get_client

    @flow(name="auth-probe")
    def tiny(x: int) -> int:
        return x + 1

    state = tiny(41, return_state=True)
    with get_client(sync_client=True) as client:
        recorded = client.read_flow_run(state.state_details.flow_run_id)
    print("RESULT", state.type.value, state.result(), recorded.state.type.value, sorted(recorded.parameters.items()))
""")


@pytest.mark.parametrize("credential", ["env", "file"])
def test_a_flow_run_with_the_right_credential_completes(auth_server, tmp_path, credential):
    """With PREFECT_API_AUTH_STRING, or only AREAL_PIPELINE_PREFECT_AUTH_FILE (`apply_prefect_auth_file`), a flow
    run is created, runs and is recorded on the server; the credential is in none of its parameters."""
    env = _client(auth_server, tmp_path / "prefect-home", credential)
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", FLOW], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=180)
    elapsed = time.monotonic() - started
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "RESULT COMPLETED 42 COMPLETED [('x', 41)]" in done.stdout, out[-4000:]
    assert AUTH not in out
    print(f"flow run with the credential from {credential}: {elapsed:.1f} s")


@pytest.mark.parametrize("credential", ["wrong", "none"])
def test_a_refused_command_fails_at_once_naming_the_setting(auth_server, tmp_path, credential):
    """`areal-pipeline sweep` (its first API call, before any run starts) with a wrong PREFECT_API_AUTH_STRING or
    none: exits within seconds, its last line naming PREFECT_API_AUTH_STRING, neither string in its output."""
    env = _client(auth_server, tmp_path / "prefect-home", credential)
    started = time.monotonic()
    done = _run("sweep", "--config", "configs/tiny_cpu.yaml", "--iterations", "1", f"output_dir={tmp_path}",
                "trainer.optimizer.lr=1e-3", env=env, timeout=120)
    elapsed = time.monotonic() - started
    out = done.stdout + done.stderr
    assert done.returncode != 0, out[-4000:]
    assert elapsed < FAIL_FAST_S, (elapsed, out[-4000:])
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("sweep failed: PrefectAuthError: ") and CLIENT_AUTH_ENV in last, out[-4000:]
    assert ("is not set" in last) == (credential == "none"), last
    assert AUTH not in out and WRONG not in out
    assert not list(tmp_path.glob("tiny-cpu*")), "a run started"
    print(f"refused ({credential}): {elapsed:.1f} s: {last}")


def test_status_start_again_and_stop_with_auth_on(auth_server, tmp_path):
    """`status` says whether this shell's credential is taken; `start` of the running server with its auth string
    keeps it, with another one or none asked for it is refused (`stop` is the fixture's teardown)."""
    directory = str(auth_server["dir"])
    home = tmp_path / "prefect-home"
    for credential, said in (("env", "accepted"), ("file", "accepted"), ("wrong", "refused"), ("none", "not set")):
        status = _ok("prefect-server", "status", "--dir", directory, env=_client(auth_server, home, credential))
        assert "prefect_server: healthy" in status and "auth:           basic (" in status, status
        assert said in status.split("auth:")[1], (credential, status)
    port = auth_server["url"].split(":")[-1].split("/")[0]
    again = _ok("prefect-server", "start", "--dir", directory, "--port", port, "--auth-file",
                str(auth_server["auth_file"]), env=auth_server["env"], timeout=60)
    assert "running already" in again, again
    other = {**auth_server["env"], SERVER_AUTH_ENV: WRONG}
    done = _run("prefect-server", "start", "--dir", directory, "--port", port, env=other, timeout=60)
    assert done.returncode != 0 and "another auth string" in done.stderr, done.stdout + done.stderr
    assert WRONG not in done.stdout + done.stderr


def test_an_auth_file_others_may_read_is_refused(tmp_path):
    """`prefect-server start` refuses an auth file of mode 0644 (by --auth-file or AREAL_PIPELINE_PREFECT_AUTH_FILE)
    before it starts anything; so does a client's `apply_prefect_auth_file`."""
    loose = _write_secret(tmp_path / "auth", AUTH, mode=0o644)
    directory = tmp_path / "never-made"
    env = _server_env()
    for how, extra, args in (("--auth-file", {}, ["--auth-file", str(loose)]),
                             (AUTH_FILE_ENV, {AUTH_FILE_ENV: str(loose)}, [])):
        started = time.monotonic()
        done = _run("prefect-server", "start", "--dir", str(directory), "--port", str(find_free_port()), *args,
                    env={**env, **extra}, timeout=60)
        out = done.stdout + done.stderr
        assert done.returncode != 0, out
        assert "mode 0644" in out and "chmod 600" in out and how in out, out
        assert AUTH not in out and not directory.exists()
        print(f"0644 by {how} refused in {time.monotonic() - started:.1f} s")
    environ = {AUTH_FILE_ENV: str(loose)}
    with pytest.raises(PrefectAuthError, match="mode 0644"):
        apply_prefect_auth_file(environ)
    assert CLIENT_AUTH_ENV not in environ
    loose.chmod(0o600)
    assert apply_prefect_auth_file(environ) == str(loose) and environ[CLIENT_AUTH_ENV] == AUTH
