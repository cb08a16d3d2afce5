"""Supervision of a service process: started (a command line, or a fork of the preloaded forkserver), waited for
until it answers over HTTP, and stopped with everything it started. Nothing here knows what the service is: the
inference servers, the trainer and the tool servers are all `ServerProcess`es.

    with ServerProcess(command, "127.0.0.1:8000", log_path) as server:
        server.wait_healthy(timeout=60)
        ...
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Optional

import psutil

from areal_pipeline import auth
from areal_pipeline.utils import PARENT_PID_ENV, get_logger

logger = get_logger(__name__)

LOG_TAIL_LINES = 40


class ServerLaunchError(RuntimeError):
    pass


def _log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(deque(f, maxlen=lines))
    except OSError as e:
        return f"<log {path} unreadable: {e}>"


class ServerProcess:
    """One server process, in its own session so that `stop` can take down everything it started."""

    def __init__(self, command: list[str], address: str, log_path: Optional[Path] = None,
                 env: Optional[dict[str, str]] = None, fork: Optional[tuple[str, list[str], dict[str, str]]] = None,
                 kind: str = "service", liveness_path: str = "/health"):
        """`fork`: (module, argv, extra environment) of the same service as a fork of the preloaded forkserver
        (areal_pipeline/forkserver.py), tried before `command`. `kind` names the service in logs and errors.
        `liveness_path`: what a run asks a server it may have paused (where /health would wait for it)."""
        self.kind = kind
        self.liveness_path = liveness_path
        self.command = list(command)
        self.address = address
        self.log_path = Path(log_path) if log_path is not None else None
        self.env = env
        self.fork = fork
        self.popen: Optional[subprocess.Popen] = None

    def __enter__(self) -> "ServerProcess":
        if self.popen is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "ServerProcess":
        if self.popen is not None:
            raise RuntimeError(f"server {self.address} was already started")
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="areal-server-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logger.info("starting %s %s (log: %s): %s", self.kind, self.address, self.log_path, " ".join(self.command))
        # a service started here demands the token its starter has, made now where none was given
        token = auth.ensure_run_token()
        env = {**(self.env if self.env is not None else os.environ), PARENT_PID_ENV: str(os.getpid())}
        if token is not None and auth.TOKEN_ENV not in env and auth.TOKEN_FILE_ENV not in env:
            env[auth.TOKEN_ENV] = token  # an environment built before the token was made
        # Idle OpenMP threads spin by default: a server waiting for the trainer (or the other way round)
        # would then eat the cores the busy one needs (5x slower iterations measured on 2 cores).
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        if self.fork is not None and env["OMP_WAIT_POLICY"] == "PASSIVE":  # the forkserver's policy
            from areal_pipeline import forkserver

            module, argv, extra = self.fork
            self.popen = forkserver.fork_service(module, argv, self.log_path, {**env, **extra})
            if self.popen is not None:
                return self
        with open(self.log_path, "ab") as log:
            self.popen = subprocess.Popen(
                self.command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env=env,
            )
        return self

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return _log_tail(self.log_path, lines) if self.log_path is not None else ""

    def is_healthy(self, path: str = "/health", timeout: float = 5.0) -> bool:
        """Whether `GET path` answers 200 within `timeout`. SGLang's /health generates a token: on a paused server
        it waits, and answers 503 after ~20 s; a probe of a server that may be paused asks LIVENESS_PATH instead."""
        try:
            with auth.opener().open(auth.request(self.address, path), timeout=timeout) as resp:
                return resp.status == 200
        except OSError:  # refused, reset, timed out, or an HTTP error status (503 while loading)
            return False

    def check_healthy(self) -> bool:
        """Whether `GET /health` answers 200; if the process has died, stop what is left and raise."""
        if self.popen is None:
            raise RuntimeError(f"server {self.address} was never started")
        code = self.popen.poll()
        if code is not None:
            self.stop()
            raise ServerLaunchError(
                f"{self.kind} {self.address} exited with code {code} before becoming healthy. "
                f"Last lines of {self.log_path}:\n{self.log_tail()}"
            )
        return self.is_healthy()

    def wait_healthy(self, timeout: float) -> None:
        wait_all_healthy([self], timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL whatever is left after `timeout`; also children that left the group."""
        if self.popen is None:
            return
        children = []
        # Once the server is reaped its pid may belong to someone else; its orphans are then found by group.
        if self.popen.poll() is None:
            try:
                children = psutil.Process(self.popen.pid).children(recursive=True)
            except psutil.NoSuchProcess:
                pass
        deadline = time.monotonic() + timeout
        self._signal_group(signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        _, alive = psutil.wait_procs(children, timeout=max(0.0, deadline - time.monotonic()))
        self._signal_group(signal.SIGKILL)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        self.popen.wait()
        psutil.wait_procs(alive, timeout=5)

    def _signal_group(self, sig: int) -> None:
        # start_new_session made the server its own process-group leader: pgid == pid.
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def wait_all_healthy(servers: list[ServerProcess], timeout: float) -> None:
    """Poll all servers together, so that one dying is reported at once; on timeout, stop them and raise."""
    deadline = time.monotonic() + timeout
    pending = list(servers)
    while True:
        pending = [s for s in pending if not s.check_healthy()]
        if not pending:
            return
        if time.monotonic() >= deadline:
            for server in pending:
                server.stop()
            raise ServerLaunchError("\n".join(
                f"{s.kind} {s.address} not healthy after {timeout:.0f}s. "
                f"Last lines of {s.log_path}:\n{s.log_tail()}" for s in pending
            ))
        time.sleep(0.05)  # a forked server is healthy ~0.15 s after it is asked for
