"""The Prefect API a command runs its flows against: the configured one (`PREFECT_API_URL`), else a temporary
server of its own for as long as the command runs.

Prefect would start such a server by itself ("ephemeral mode"), but as a plain child in the command's process
group: Ctrl-C in a terminal reaches it together with the run, it dies first, and the run then spends minutes
retrying API calls to a dead address and finally hangs in Prefect's at-exit log drain. This one runs in its own
session, so a stop signal reaches only the command, which records the run as crashed and then stops the server
(it is not among what a stop signal stops first, see areal_pipeline/shutdown.py); and like the run's services it
exits by itself when the command is gone (kill -9, or the forced exit after a stop signal). Its database is Prefect's
default (`$PREFECT_HOME/prefect.db`, as in ephemeral mode): `prefect server start` later shows the same runs.

    python -m flows.api_server --port PORT     (what `temporary_api` starts)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Iterator, Optional

from areal_pipeline.prefect_auth import SERVER_AUTH_ENV, PrefectAuthError, unauthorized_message
from areal_pipeline.utils import PARENT_PID_ENV, exit_when_parent_dies, find_free_port, get_logger

logger = get_logger(__name__)

_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class TemporaryAPIServer:
    """A Prefect API server process on 127.0.0.1 (no UI), started at once and waited for when first needed, so
    that its start (seconds: it imports Prefect's server) overlaps the command's own set-up. Its own log goes to
    a file, not the command's terminal (a server stopped mid-flush logs a traceback there, its events still
    written by the final flush), and the file is removed when it stops cleanly; a failure to start quotes it."""

    def __init__(self, startup_timeout: float = 180.0):
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}/api"
        self.startup_timeout = startup_timeout
        env = {**os.environ, PARENT_PID_ENV: str(os.getpid()), "PREFECT_UI_ENABLED": "0"}
        env.pop("PREFECT_API_URL", None)
        # an auth string meant for a standing server (`prefect-server start` from the same shell) is not this one's:
        # the command's client might not send it
        env.pop(SERVER_AUTH_ENV, None)
        fd, self.log_path = tempfile.mkstemp(prefix=f"prefect-api-{self.port}-", suffix=".log")
        with os.fdopen(fd, "w") as log:
            self.popen = subprocess.Popen(
                [sys.executable, "-m", "flows.api_server", "--port", str(self.port)], env=env,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def _log_tail(self, lines: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self) -> str:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.popen is None or self.popen.poll() is not None:
                raise RuntimeError(f"the temporary Prefect API server exited with code "
                                   f"{None if self.popen is None else self.popen.returncode} before answering; "
                                   f"its log ({self.log_path}) ends:\n{self._log_tail()}")
            try:
                with _opener.open(f"{self.url}/health", timeout=5) as reply:
                    if reply.status == 200:
                        return self.url
            except OSError:
                pass
            time.sleep(0.1)
        tail = self._log_tail()
        self.stop()
        raise RuntimeError(f"the temporary Prefect API server did not answer within {self.startup_timeout:.0f} s; "
                           f"its log ends:\n{tail}")

    def stop(self) -> None:
        popen, self.popen = self.popen, None
        if popen is None or popen.poll() is not None:
            return
        popen.terminate()
        try:
            popen.wait(5)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()
        with contextlib.suppress(OSError):
            os.unlink(self.log_path)


def _may_name_an_api() -> bool:
    """Whether the environment or a file Prefect reads its settings from may name an API (a cheap look, before
    Prefect's settings are imported; `configured_api_url` decides)."""
    if os.environ.get("PREFECT_API_URL"):
        return True
    home = Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()
    profiles = Path(os.environ.get("PREFECT_PROFILES_PATH") or home / "profiles.toml").expanduser()
    for path, mark in ((profiles, "PREFECT_API_URL"), (Path(".env"), "PREFECT_API_URL"),
                       (Path("prefect.toml"), ""), (Path("pyproject.toml"), "tool.prefect")):
        try:
            if mark in path.read_text(errors="replace"):
                return True
        except OSError:
            continue
    return False


def early_api_server() -> Optional[TemporaryAPIServer]:
    """The temporary server a command will run its flows against, started now unless an API may be configured:
    its start (seconds of imports) then overlaps the command's own imports, Prefect's settings among them.
    Pass it to `needed_api_server`, which stops it if Prefect's settings do name an API after all."""
    return None if _may_name_an_api() else TemporaryAPIServer()


def needed_api_server(early: Optional[TemporaryAPIServer]) -> Optional[TemporaryAPIServer]:
    """The temporary server to use (`early`, or one started now), or None where Prefect's settings name an API
    (which must take this command's credential: `require_api_access`)."""
    url = configured_api_url()
    if url is not None:
        if early is not None:
            early.stop()
        require_api_access(url)
        return None
    return early or TemporaryAPIServer()


def configured_api_url() -> Optional[str]:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or None


ACCESS_CHECK_TIMEOUT_S = 10.0
_access_checked: set[str] = set()


def require_api_access(url: Optional[str] = None) -> None:
    """A `PrefectAuthError` naming PREFECT_API_AUTH_STRING where the configured Prefect API (`url`, default
    PREFECT_API_URL) refuses this process's credential (401/403), at once: Prefect's own error names neither the
    setting nor what to do. One API call, made as Prefect's client makes it (its settings, headers, proxies, TLS),
    without retries and within ACCESS_CHECK_TIMEOUT_S; once a process and URL. An API that does not answer is not
    this check's to judge: Prefect's client retries and reports it as before. Nothing where no API is configured
    (the temporary server is the command's own) or for Prefect Cloud (an API key, not an auth string)."""
    url = url or configured_api_url()
    if url is None or url in _access_checked:
        return
    from prefect.client.base import ServerType
    from prefect.client.orchestration import get_client
    from prefect.exceptions import PrefectHTTPStatusError
    from prefect.settings import (PREFECT_API_AUTH_STRING, PREFECT_API_REQUEST_TIMEOUT, PREFECT_API_URL,
                                  PREFECT_CLIENT_MAX_RETRIES, temporary_settings)

    with temporary_settings(updates={PREFECT_API_URL: url, PREFECT_CLIENT_MAX_RETRIES: 0,
                                     PREFECT_API_REQUEST_TIMEOUT: ACCESS_CHECK_TIMEOUT_S}):
        try:
            with get_client(sync_client=True) as client:
                if client.server_type == ServerType.CLOUD:
                    _access_checked.add(url)
                    return
                client.api_version()
        except PrefectHTTPStatusError as error:
            status = error.response.status_code
            if status in (401, 403):
                raise PrefectAuthError(unauthorized_message(url, bool(PREFECT_API_AUTH_STRING.value()), status)) \
                    from None
            logger.debug("Prefect API access check of %s: HTTP %s", url, status)
            return
        except Exception as error:  # unreachable, slow: Prefect's client says so at the command's first call
            logger.debug("Prefect API access check of %s: %s", url, error)
            return
    _access_checked.add(url)


@contextlib.contextmanager
def prefect_api(server: Optional[TemporaryAPIServer] = None) -> Iterator[str]:
    """Run the block against the configured Prefect API, else against `server` (started here if not given),
    which is stopped when the block ends."""
    url = configured_api_url()
    if url is not None:
        if server is not None:
            server.stop()
        require_api_access(url)
        yield url
        return
    from prefect.settings import PREFECT_API_URL, temporary_settings

    server = server or TemporaryAPIServer()
    try:
        url = server.wait_ready()
        logger.info("Prefect API: temporary server %s (set PREFECT_API_URL to use a standing one)", url)
        with temporary_settings(updates={PREFECT_API_URL: url}):
            try:
                yield url
            finally:
                deliver_queued_logs_and_events()
    finally:
        server.stop()


def deliver_queued_logs_and_events(timeout: float = 3.0) -> None:
    """Send what Prefect's background workers still hold (run logs, state events) now, while the server is
    there: they would otherwise do it at interpreter exit, after the server is gone, retrying for minutes."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=timeout)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    exit_when_parent_dies()
    import uvicorn

    uvicorn.run("flows.api_server:create_app", factory=True, host="127.0.0.1", port=args.port,
                log_level="error", lifespan="on")


def create_app():
    """The API app as Prefect's own ephemeral server runs it: no UI, the services an in-process run needs, and the
    only app of its process (`final`)."""
    from prefect.server.api.server import create_app as create_prefect_app

    return create_prefect_app(ephemeral=True, final=True)


if __name__ == "__main__":
    main()
