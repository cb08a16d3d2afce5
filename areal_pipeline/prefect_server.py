"""A standing Prefect server on PostgreSQL for one machine, from the PostgreSQL binaries on PATH.

    areal-pipeline prefect-server start|stop|status [--dir DIR] [--port 4200] [--pg-port 5433]

`start` makes the database cluster on first use (`initdb`, then `CREATE DATABASE prefect` in PostgreSQL's
single-user mode), starts it with `pg_ctl` on 127.0.0.1 (its unix socket inside DIR), then starts
`prefect server start --host 127.0.0.1` on it (`PREFECT_API_DATABASE_CONNECTION_URL=postgresql+asyncpg://...`,
`PREFECT_UI_API_URL` naming its own port: see `server_env`) in a session of its own, waits for /api/health and
returns the API URL to export. `stop` stops the Prefect server, then PostgreSQL (`pg_ctl stop -m fast`). Nothing
listens beyond loopback.

Prefect's default SQLite database serialises every write: against a standing server, concurrent runs and the
task-run recorder then wait on "database is locked" (docs/prefect.md, "A standing Prefect server"). PostgreSQL does not.

PostgreSQL refuses to run as root; run as root, its commands run as the `postgres` user, who owns DIR/postgres.
The database password is generated at `initdb` and kept in DIR/db-password (mode 0600).

Authentication: Prefect's basic auth, the string given to the server by environment alone (prefect_auth.py).

Prefect runs as a subprocess (the `prefect` next to this Python, else on PATH): the library never imports it.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from areal_pipeline.prefect_auth import (
    AUTH_FILE_ENV,
    SERVER_AUTH_ENV,
    PrefectServerError,
    auth_not_enforced,
    auth_status,
    check_running_auth,
    server_auth_string,
)

DATABASE = "prefect"
DB_USER = "postgres"
DEFAULT_PORT = 4200
DEFAULT_PG_PORT = 5433  # 5432 is where a system PostgreSQL listens
PG_BINARIES = ("initdb", "pg_ctl", "postgres")
UNIX_SOCKET_PATH_MAX = 107  # sun_path, less its terminating NUL

# no internet here, and no reason for a server to phone home anywhere
QUIET_ENV = {"PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"}
# Prefect's task-run recorder writes each task run's state change in a transaction of its own (batch size 1): with
# runs of sub-second iterations that is a commit per node and state, whose server and database CPU the run on the
# same cores loses (bench/prefect_backends.py). Batched, a task run's state reaches the UI up to the flush interval
# late. A value in the environment of `prefect-server start` wins.
SERVER_DEFAULTS = {"PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "100",
                   "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1"}

_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def server_env(environ: dict[str, str], url: str) -> dict[str, str]:
    """The environment of `prefect server start` serving the API at `url`: SERVER_DEFAULTS under `environ`, and the
    URL the UI's pages call. Prefect's UI reads that URL from the server's `/ui-settings`, which serves
    PREFECT_UI_API_URL, else PREFECT_API_URL, else PREFECT_SERVER_API_HOST/PORT (default 4200): not `--port`, so a
    UI on another port would call 4200's API. A UI URL in `environ` wins (e.g. a server behind a proxy)."""
    env = {**SERVER_DEFAULTS, **environ}
    env.pop("PREFECT_API_URL", None)  # the server is not a client of another one
    if not (env.get("PREFECT_UI_API_URL") or env.get("PREFECT_SERVER_UI_API_URL")):
        env["PREFECT_UI_API_URL"] = url
    return env



def default_dir() -> Path:
    # root's home is closed to the postgres user, who must reach the data directory
    if os.geteuid() == 0:
        return Path("/var/lib/areal-pipeline/prefect-server")
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "areal-pipeline" / "prefect-server"


def postgres_binaries() -> dict[str, str]:
    """initdb, pg_ctl and postgres: from PATH, else from the newest /usr/lib/postgresql/<version>/bin (Debian and
    Ubuntu install them there, off PATH)."""
    found = {name: shutil.which(name) for name in PG_BINARIES}
    if all(found.values()):
        return found  # type: ignore[return-value]
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin"),
                      key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)
    for bin_dir in reversed(versions):
        if all((bin_dir / name).is_file() for name in PG_BINARIES):
            return {name: str(bin_dir / name) for name in PG_BINARIES}
    missing = ", ".join(name for name, path in found.items() if not path)
    raise PrefectServerError(f"PostgreSQL binaries not found on PATH ({missing}): install PostgreSQL (e.g. "
                             f"apt-get install postgresql) and put its bin directory (e.g. "
                             f"/usr/lib/postgresql/15/bin) on PATH")


def prefect_executable() -> str:
    beside = Path(sys.executable).parent / "prefect"
    if beside.is_file():
        return str(beside)
    found = shutil.which("prefect")
    if not found:
        raise PrefectServerError("the `prefect` command was not found beside this Python or on PATH")
    return found


@dataclass
class _PgUser:
    """Who PostgreSQL's commands run as: this process's user, or `postgres` when this is root."""
    uid: int
    gid: int
    name: str

    @property
    def switches(self) -> bool:
        return self.uid != os.geteuid()

    def run(self, command: list[str], **kwargs) -> subprocess.CompletedProcess:
        if self.switches:
            kwargs.update(user=self.uid, group=self.gid, extra_groups=[])
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C", "HOME": kwargs.pop("home", "/")}
        return subprocess.run(command, env=env, capture_output=True, text=True, **kwargs)


def _pg_user() -> _PgUser:
    if os.geteuid() != 0:
        return _PgUser(os.geteuid(), os.getegid(), pwd.getpwuid(os.geteuid()).pw_name)
    try:
        entry = pwd.getpwnam("postgres")
    except KeyError:
        raise PrefectServerError("PostgreSQL refuses to run as root, and there is no `postgres` user to run it as: "
                                 "create one (useradd --system postgres) or run this as another user") from None
    return _PgUser(entry.pw_uid, entry.pw_gid, entry.pw_name)


def _unreachable_ancestor(path: Path, user: _PgUser) -> Optional[Path]:
    """The first directory above `path` that `user` cannot enter, if any."""
    groups = set(os.getgrouplist(user.name, user.gid))
    for parent in reversed(path.resolve().parents):
        st = parent.stat()
        if st.st_uid == user.uid:
            ok = st.st_mode & stat.S_IXUSR
        elif st.st_gid in groups:
            ok = st.st_mode & stat.S_IXGRP
        else:
            ok = st.st_mode & stat.S_IXOTH
        if not ok:
            return parent
    return None


def _port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _healthy(url: str) -> bool:
    try:
        with _opener.open(f"{url}/health", timeout=5) as reply:
            return reply.status == 200
    except OSError:
        return False


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


class LocalPrefectServer:
    """The PostgreSQL cluster and the Prefect server kept in one directory:

        DIR/postgres/data          the cluster (PGDATA); DIR/postgres also holds its unix socket and log
        DIR/db-password            the database password (0600)
        DIR/prefect/               PREFECT_HOME of the server
        DIR/prefect-server.log     the server's output
        DIR/server.json            ports, URL and pid of the running server
    """

    def __init__(self, directory: Optional[Path | str] = None):
        self.dir = Path(directory).expanduser().absolute() if directory else default_dir()
        self.pg_dir = self.dir / "postgres"
        self.pg_data = self.pg_dir / "data"
        self.pg_log = self.pg_dir / "postgres.log"
        self.password_file = self.dir / "db-password"
        self.prefect_home = self.dir / "prefect"
        self.server_log = self.dir / "prefect-server.log"
        self.state_file = self.dir / "server.json"

    # ---- state
    def state(self) -> dict:
        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}

    def _write_state(self, state: dict) -> None:
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=2) + "\n")
        tmp.replace(self.state_file)

    def database_url(self, pg_port: int, with_password: bool = True) -> str:
        secret = f":{self.password_file.read_text().strip()}" if with_password else ""
        return f"postgresql+asyncpg://{DB_USER}{secret}@127.0.0.1:{pg_port}/{DATABASE}"

    # ---- PostgreSQL
    def _prepare_dir(self, user: _PgUser) -> None:
        created = [p for p in [self.dir, *self.dir.parents] if not p.exists()]
        self.dir.mkdir(parents=True, exist_ok=True)
        if user.switches:
            for directory in created:  # a restrictive umask must not lock out the postgres user
                directory.chmod(0o755)
            blocked = _unreachable_ancestor(self.pg_dir, user)
            if blocked is not None:
                raise PrefectServerError(
                    f"PostgreSQL does not run as root; it runs as the `{user.name}` user, who cannot enter {blocked} "
                    f"(mode {stat.filemode(blocked.stat().st_mode)}): choose a --dir it can reach, e.g. "
                    f"{default_dir()}")
        self.pg_dir.mkdir(mode=0o700, exist_ok=True)
        if user.switches:
            os.chown(self.pg_dir, user.uid, user.gid)
        socket_path = self.pg_dir / f".s.PGSQL.{DEFAULT_PG_PORT:05d}"
        if len(str(socket_path)) > UNIX_SOCKET_PATH_MAX:
            raise PrefectServerError(f"--dir {self.dir} is too long for PostgreSQL's unix socket path "
                                     f"({len(str(socket_path))} > {UNIX_SOCKET_PATH_MAX} characters): choose a "
                                     f"shorter one")

    def _initdb(self, user: _PgUser, bins: dict[str, str]) -> None:
        """A new cluster that accepts password (SCRAM) logins only, and its `prefect` database."""
        password = secrets.token_urlsafe(24)
        fd = os.open(self.password_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
        pwfile = self.pg_dir / "initdb-password"
        fd = os.open(pwfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(password + "\n")
        if user.switches:
            os.chown(pwfile, user.uid, user.gid)
        try:
            done = user.run([bins["initdb"], "-D", str(self.pg_data), "-U", DB_USER, "--auth=scram-sha-256",
                             f"--pwfile={pwfile}", "--encoding=UTF8", "--locale=C"], cwd=self.pg_dir)
        finally:
            pwfile.unlink(missing_ok=True)
        if done.returncode != 0:
            shutil.rmtree(self.pg_data, ignore_errors=True)  # a half-made cluster would be taken for a made one
            raise PrefectServerError(f"initdb failed ({done.returncode}): {(done.stdout + done.stderr)[-2000:]}")
        with open(self.pg_data / "postgresql.conf", "a") as conf:
            conf.write("\n# areal-pipeline prefect-server: loopback only, the socket beside the data\n"
                       f"listen_addresses = '127.0.0.1'\nunix_socket_directories = '{self.pg_dir}'\n")
        # single-user mode: the database exists before the server first listens
        done = user.run([bins["postgres"], "--single", "-D", str(self.pg_data), "-F", "-c", "listen_addresses=",
                         "postgres"], input=f"CREATE DATABASE {DATABASE};\n", cwd=self.pg_dir)
        if done.returncode != 0 or "ERROR" in done.stdout + done.stderr:
            shutil.rmtree(self.pg_data, ignore_errors=True)
            raise PrefectServerError(f"CREATE DATABASE {DATABASE} failed: {(done.stdout + done.stderr)[-2000:]}")

    def postgres_running(self) -> bool:
        if not (self.pg_data / "PG_VERSION").is_file():
            return False
        done = _pg_user().run([postgres_binaries()["pg_ctl"], "status", "-D", str(self.pg_data)], cwd="/")
        return done.returncode == 0

    def _start_postgres(self, pg_port: int, timeout: float) -> bool:
        """Start the cluster (made on first use); False if it was running already."""
        bins = postgres_binaries()
        user = _pg_user()
        self._prepare_dir(user)
        if not (self.pg_data / "PG_VERSION").is_file():
            self._initdb(user, bins)
        elif self.postgres_running():
            return False
        if not _port_free(pg_port):
            raise PrefectServerError(f"port {pg_port} on 127.0.0.1 is in use: choose another with --pg-port")
        done = user.run([bins["pg_ctl"], "start", "-D", str(self.pg_data), "-l", str(self.pg_log), "-w",
                         "-t", str(int(timeout)), "-o", f"-p {pg_port}"], cwd=self.pg_dir)
        if done.returncode != 0:
            raise PrefectServerError(f"pg_ctl start failed ({done.returncode}): {done.stdout + done.stderr}\n"
                                     f"{self.pg_log}:\n{_tail(self.pg_log)}")
        return True

    def _stop_postgres(self) -> bool:
        if not self.postgres_running():
            return False
        done = _pg_user().run([postgres_binaries()["pg_ctl"], "stop", "-D", str(self.pg_data), "-m", "fast", "-w",
                               "-t", "60"], cwd="/")
        if done.returncode != 0:
            raise PrefectServerError(f"pg_ctl stop failed ({done.returncode}): {done.stdout + done.stderr}")
        return True

    # ---- Prefect
    def server_pid(self) -> Optional[int]:
        """The pid of the Prefect server this directory started, if that process is still there."""
        pid = self.state().get("pid")
        if not pid:
            return None
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return None
        # a pid reused by another process is not ours to stop
        return pid if b"server" in cmdline and any(b"prefect" in part for part in cmdline) else None

    def start(self, port: int = DEFAULT_PORT, pg_port: int = DEFAULT_PG_PORT, timeout: float = 180,
              extra_env: Optional[dict[str, str]] = None,
              say: Callable[[str], None] = lambda line: None, host: str = "127.0.0.1",
              auth_string: Optional[str] = None) -> str:
        """PostgreSQL and the Prefect server on it (either one left as it is where it runs already); the API URL.
        `host`: the address the server listens on (another host's workers and runs reach it there); PostgreSQL
        stays on this host's loopback, reached by the server alone. `auth_string`: the server demands it of every
        client (Prefect's basic auth, PREFECT_SERVER_API_AUTH_STRING), given to it by environment alone; checked
        once the server answers (refused without it, accepted with it). None: the one that `extra_env` over this
        process's environment gives (`server_auth_string`), if any."""
        url = f"http://{host}:{port}/api"
        if auth_string is None:
            auth_string = server_auth_string(environ={**os.environ, **(extra_env or {})})
        if self.server_pid() is not None:
            running = self.state()
            if _healthy(running["url"]):
                check_running_auth(running["url"], auth_string, self.dir)
                say(f"the Prefect server of {self.dir} is running already (pid {running['pid']})")
                return running["url"]
            raise PrefectServerError(f"the Prefect server of {self.dir} (pid {running['pid']}) runs but does not "
                                     f"answer at {running['url']}: stop it first")
        if not _port_free(port, host):
            raise PrefectServerError(f"port {port} on {host} is in use (another Prefect server?): choose another "
                                     f"with --port")
        if self.postgres_running():
            pg_port = self.state().get("pg_port", pg_port)
        started_postgres = self._start_postgres(pg_port, timeout)
        say(f"PostgreSQL {'started' if started_postgres else 'was running'}: {self.database_url(pg_port, False)} "
            f"(data {self.pg_data})")
        self.prefect_home.mkdir(exist_ok=True)
        env = server_env({**os.environ, **QUIET_ENV, **(extra_env or {}),
                          "PREFECT_HOME": str(self.prefect_home),
                          "PREFECT_API_DATABASE_CONNECTION_URL": self.database_url(pg_port)}, url)
        env.pop(AUTH_FILE_ENV, None)  # the server is given the string itself
        if auth_string:  # by environment: argv is anyone's to read (ps, /proc/PID/cmdline)
            env[SERVER_AUTH_ENV] = auth_string
        else:
            env.pop(SERVER_AUTH_ENV, None)
        with open(self.server_log, "ab") as log:
            server = subprocess.Popen([prefect_executable(), "server", "start", "--host", host, "--port",
                                       str(port)], env=env, stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True, cwd=self.dir)
        self._write_state({"pid": server.pid, "url": url, "port": port, "pg_port": pg_port,
                           "database_url": self.database_url(pg_port, False), "auth": bool(auth_string)})

        def fail(why: str) -> PrefectServerError:
            _stop_group(server.pid, 30)
            if started_postgres:
                self._stop_postgres()
            return PrefectServerError(f"prefect server start {why}; {self.server_log}:\n{_tail(self.server_log)}")

        deadline = time.monotonic() + timeout
        while not _healthy(url):
            if server.poll() is not None or time.monotonic() > deadline:
                raise fail(f"exited with {server.returncode}" if server.poll() is not None
                           else f"did not answer within {timeout:.0f} s")
            time.sleep(0.3)
        if (not_enforced := auth_not_enforced(url, auth_string)) is not None:
            raise fail(not_enforced)
        say(f"Prefect server: {url} (UI http://{host}:{port}, pid {server.pid}, log {self.server_log}"
            f"{', basic authentication' if auth_string else ''})")
        return url

    def stop(self, timeout: float = 30, say: Callable[[str], None] = lambda line: None) -> None:
        """The Prefect server first (it holds connections to the database), then PostgreSQL."""
        pid = self.server_pid()
        if pid is not None:
            _stop_group(pid, timeout)
            say(f"Prefect server (pid {pid}) stopped")
        state = self.state()
        if state.pop("pid", None) is not None:
            self._write_state(state)
        if self._stop_postgres():
            say(f"PostgreSQL stopped (data kept in {self.pg_data})")

    def status(self, client_auth_string: Optional[str] = None) -> dict:
        """`auth`, for a server that answers: whether it demands an auth string, and whether it takes
        `client_auth_string` (this process's PREFECT_API_AUTH_STRING)."""
        state = self.state()
        pid = self.server_pid()
        healthy = bool(pid) and _healthy(state["url"])
        status = {"dir": str(self.dir), "postgres": "running" if self.postgres_running() else "stopped",
                  "database_url": state.get("database_url"),
                  "prefect_server": ("healthy" if healthy else "not answering") if pid else "stopped",
                  "pid": pid, "url": state.get("url") if pid else None}
        if healthy:
            status["auth"] = auth_status(state["url"], client_auth_string)
        return status


def _stop_group(pid: int, timeout: float) -> None:
    """SIGINT to the server's process group (as Ctrl-C: uvicorn shuts down cleanly), SIGKILL after `timeout`."""
    try:
        group = os.getpgid(pid)
        os.killpg(group, signal.SIGINT)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        _reap(pid)
        time.sleep(0.1)
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(pid: int) -> None:
    """A server started by this very process stays a zombie (and its group alive) until waited for."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass

