"""The Prefect API's basic auth, for the project's standing server and every client of it.

Prefect checks `Authorization: Basic base64(auth string)` on every API call but GET /health and /ready against the
server's PREFECT_SERVER_API_AUTH_STRING (401 otherwise); clients (the CLI, workers, flow runs) send
PREFECT_API_AUTH_STRING. The string is given by environment or by a file (mode 0600, one line) that
AREAL_PIPELINE_PREFECT_AUTH_FILE names, so that hosts are given the file's path, not the string; never on a
command line or in a log. Standard library only: the CLI reads the file before Prefect is imported.
"""

from __future__ import annotations

import os
import stat
import urllib.error
import urllib.request
from pathlib import Path
from typing import MutableMapping, Optional
from urllib.parse import urlsplit, urlunsplit

_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class PrefectServerError(RuntimeError):
    """A local server that cannot be started, stopped or found; the message says what to do."""


SERVER_AUTH_ENV = "PREFECT_SERVER_API_AUTH_STRING"  # the server's
CLIENT_AUTH_ENV = "PREFECT_API_AUTH_STRING"  # what every client (CLI, worker, flow run) sends
AUTH_FILE_ENV = "AREAL_PIPELINE_PREFECT_AUTH_FILE"  # a file holding it, for the server and clients alike
AUTH_PROBE_PATH = "/admin/version"  # a cheap API route behind the auth middleware (no database)


class PrefectAuthError(PrefectServerError):
    """A credential that is missing, refused, or kept where others can read it; the message names the setting,
    never the credential."""


def display_url(url: str) -> str:
    """`url` without a user:password part, for messages."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def read_auth_file(path: str | Path, setting: str = "--auth-file") -> str:
    """The auth string kept in the file at `path`: its one line, surrounding whitespace (the trailing newline)
    dropped. The file must be a regular file that only its owner may read or write (mode 0600 or 0400); `setting`
    names where the path came from, for the message."""
    path = Path(path).expanduser()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO given by mistake must not block
    except OSError as e:
        raise PrefectAuthError(f"{setting}: cannot read the auth file {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)  # of the file opened, not of whatever the path names by now
        if not stat.S_ISREG(st.st_mode):
            raise PrefectAuthError(f"{setting}: the auth file {path} is not a regular file")
        if st.st_mode & 0o077:
            raise PrefectAuthError(f"{setting}: the auth file {path} may be read or written by others (mode "
                                   f"{stat.S_IMODE(st.st_mode):04o}): it must be mode 0600 (chmod 600 {path})")
        raw = os.read(fd, 65537)
    finally:
        os.close(fd)
    try:
        value = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise PrefectAuthError(f"{setting}: the auth file {path} is not UTF-8 text") from None
    if not value:
        raise PrefectAuthError(f"{setting}: the auth file {path} is empty: write the auth string (e.g. "
                               f"user:password) into it, one line")
    if len(raw) > 65536 or "\n" in value or "\r" in value:
        raise PrefectAuthError(f"{setting}: the auth file {path} must hold one line, the auth string")
    return value


def server_auth_string(auth_file: Optional[str] = None,
                       environ: Optional[MutableMapping[str, str]] = None) -> Optional[str]:
    """The auth string `prefect-server start` gives its server (None: no authentication): `auth_file`
    (--auth-file), PREFECT_SERVER_API_AUTH_STRING and the file of AREAL_PIPELINE_PREFECT_AUTH_FILE, whichever are
    given; where several are, they must agree."""
    environ = os.environ if environ is None else environ
    given: dict[str, str] = {}
    if auth_file:
        given[f"--auth-file {auth_file}"] = read_auth_file(auth_file)
    if SERVER_AUTH_ENV in environ:
        if not environ[SERVER_AUTH_ENV].strip():
            raise PrefectAuthError(f"{SERVER_AUTH_ENV} is set but empty: unset it (no authentication) or set it to "
                                   f"the auth string (e.g. user:password)")
        given[SERVER_AUTH_ENV] = environ[SERVER_AUTH_ENV]
    if environ.get(AUTH_FILE_ENV):
        given[f"{AUTH_FILE_ENV}={environ[AUTH_FILE_ENV]}"] = read_auth_file(environ[AUTH_FILE_ENV], AUTH_FILE_ENV)
    if len(set(given.values())) > 1:
        raise PrefectAuthError(f"{' and '.join(given)} give different auth strings: give one (or make them agree)")
    return next(iter(given.values()), None)


_applied_auth_file: Optional[str] = None  # the file this process's PREFECT_API_AUTH_STRING was read from


def apply_prefect_auth_file(environ: Optional[MutableMapping[str, str]] = None) -> Optional[str]:
    """Where AREAL_PIPELINE_PREFECT_AUTH_FILE names a file and PREFECT_API_AUTH_STRING is not set, set
    PREFECT_API_AUTH_STRING (in `environ`, default os.environ) from the file, for Prefect's client in this process
    and every process it starts; the path applied, else None. PrefectAuthError for a file that cannot be used.
    Call it before Prefect is imported: Prefect reads its settings from the environment once, at import."""
    global _applied_auth_file
    own = environ is None
    environ = os.environ if environ is None else environ
    path = environ.get(AUTH_FILE_ENV)
    if not path or environ.get(CLIENT_AUTH_ENV):
        return None
    environ[CLIENT_AUTH_ENV] = read_auth_file(path, AUTH_FILE_ENV)
    if own:
        _applied_auth_file = path
    return path


def unauthorized_message(url: str, credential_given: bool, status: int = 401) -> str:
    """What a client refused by the API at `url` is told: the setting to fix, never its value."""
    source = f" (read from {AUTH_FILE_ENV}={_applied_auth_file})" if _applied_auth_file else ""
    why = (f"its {CLIENT_AUTH_ENV}{source} is not the server's auth string" if credential_given
           else f"{CLIENT_AUTH_ENV} is not set")
    reason = "Unauthorized" if status == 401 else "Forbidden"
    return (f"the Prefect API at {display_url(url)} refused this command (HTTP {status} {reason}): the server "
            f"requires basic authentication and {why}. Set {CLIENT_AUTH_ENV} to the auth string the server was "
            f"started with ({SERVER_AUTH_ENV}), or {AUTH_FILE_ENV} to a file (mode 0600) holding it")


def api_answers(url: str, auth_string: Optional[str], timeout: float = 10) -> Optional[int]:
    """The HTTP status of an API call behind the server's auth middleware (GET /admin/version), sent with
    `auth_string` (None: without credentials) as Prefect's client sends it; None where nothing answers."""
    import base64

    request = urllib.request.Request(f"{url.rstrip('/')}{AUTH_PROBE_PATH}")
    if auth_string:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth_string.encode()).decode())
    try:
        with _opener.open(request, timeout=timeout) as reply:
            return reply.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def auth_not_enforced(url: str, auth_string: Optional[str]) -> Optional[str]:
    """Why a server just started with `auth_string` does not enforce it (None: it does, or has none). /health
    answers anyone: the API itself must refuse a client without the string."""
    if not auth_string:
        return None
    without, with_it = api_answers(url, None), api_answers(url, auth_string)
    if without != 401 or with_it != 200:
        return (f"did not enforce its auth string (an API call answered {without} without it and {with_it} with "
                "it; expected 401 and 200)")
    return None


def check_running_auth(url: str, auth_string: Optional[str], directory: Path) -> None:
    """A server running already (that of `directory`) is kept only where it demands the auth string asked for."""
    if not auth_string:
        return
    if api_answers(url, auth_string) == 401:
        raise PrefectAuthError(f"the Prefect server of {directory} runs already with another auth string: stop it "
                               "first (`prefect-server stop`), or give the auth string it was started with")
    if api_answers(url, None) == 200:
        raise PrefectAuthError(f"the Prefect server of {directory} runs already without authentication: stop it "
                               "first (`prefect-server stop`), then start it with the auth string")


def auth_status(url: str, client_auth_string: Optional[str]) -> str:
    """Whether the API at `url` demands an auth string, and whether it takes `client_auth_string`."""
    without = api_answers(url, None)
    if without == 200:
        return "none (the API answers every client)"
    if without != 401:
        return f"unknown (the API answered {without})"
    if not client_auth_string:
        return f"basic ({CLIENT_AUTH_ENV} is not set here: this shell's clients are refused)"
    accepted = api_answers(url, client_auth_string) == 200
    return f"basic ({CLIENT_AUTH_ENV} here: {'accepted' if accepted else 'refused'})"


def client_auth_advice(auth_file: Optional[str]) -> tuple[str, Optional[str]]:
    """What `prefect-server start` tells the clients of a server with an auth string (never the string itself):
    a line of advice, and the `export` line of the auth file where the string came from one."""
    path = auth_file or os.environ.get(AUTH_FILE_ENV)
    if not path:
        return f"clients send the auth string: set {CLIENT_AUTH_ENV} to the value of {SERVER_AUTH_ENV}", None
    return (f"clients send the auth string: {CLIENT_AUTH_ENV}, or {AUTH_FILE_ENV} naming its file",
            f"export {AUTH_FILE_ENV}={Path(path).expanduser().absolute()}")
