"""Who may call the run's services, and over what: the run credential, and TLS where a user asks for it.

Every service the project starts (the inference server, the trainer's control endpoint, the retrieval server, the
served judge, the OpenAI-compatible API) takes a request only with the run's token, sent as
`Authorization: Bearer <token>` (what the OpenAI SDK sends for `api_key`), on every route but the bare liveness
probe. The token travels by environment or file, never on a command line, in a log or in a config:

    AREAL_PIPELINE_TOKEN        the token itself
    AREAL_PIPELINE_TOKEN_FILE   a file holding it, readable by its owner alone (mode 0600)
    AREAL_PIPELINE_AUTH=off     no credential, for every process that has it (a laptop, nothing on a network)

A run that starts its own services and is given no token uses its output directory's, `<output_dir>/.credentials/
token`, made (0600) on first use (`ensure_run_token`): every command on the same output directory (a rerun, `serve`,
a line's firings and its servers, `cluster`) then shares it, and the processes it starts inherit it.

TLS: a service given a certificate and key serves HTTPS; a client given a CA bundle speaks HTTPS and checks
the services' certificates against it.

    AREAL_PIPELINE_TLS_CERT, AREAL_PIPELINE_TLS_KEY   the services' certificate chain and private key (PEM)
    AREAL_PIPELINE_TLS_CA                             the CA bundle clients trust (PEM)

This module is the clients' and the services' shared half and imports nothing but the standard library.
"""

from __future__ import annotations

import functools
import hmac
import os
import urllib.request
import secrets
import ssl
import stat
from pathlib import Path
from typing import Optional

TOKEN_ENV = "AREAL_PIPELINE_TOKEN"
TOKEN_FILE_ENV = "AREAL_PIPELINE_TOKEN_FILE"
AUTH_ENV = "AREAL_PIPELINE_AUTH"
TLS_CERT_ENV = "AREAL_PIPELINE_TLS_CERT"
TLS_KEY_ENV = "AREAL_PIPELINE_TLS_KEY"
TLS_CA_ENV = "AREAL_PIPELINE_TLS_CA"

LIVENESS_PATH = "/health"  # the one route answered without the token, and with nothing but whether it is up
OFF_VALUES = {"off", "0", "false", "no", "none"}


class CredentialError(RuntimeError):
    """No usable credential: what is missing and how to give it, never the token itself."""


def auth_disabled() -> bool:
    return os.environ.get(AUTH_ENV, "").strip().lower() in OFF_VALUES


def read_token_file(path: str | Path) -> str:
    """The token in `path`, which only its owner may read or write (as ssh wants of a private key)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as e:
        raise CredentialError(f"{TOKEN_FILE_ENV}={path}: cannot read it ({e.strerror})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise CredentialError(f"{TOKEN_FILE_ENV}={path}: mode {stat.S_IMODE(mode):04o} lets others read or change "
                              f"it; make it the owner's alone (chmod 600 {path})")
    token = text.strip()
    if not token:
        raise CredentialError(f"{TOKEN_FILE_ENV}={path} is empty")
    return token


def write_token_file(path: str | Path, token: Optional[str] = None) -> Path:
    """A new token (or `token`) in `path`, created 0600 (its folder 0700 where this makes it), never readable by
    others even for an instant; an existing file is kept as it is (two commands making it at once agree on one:
    the first link wins)."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write((token or new_token()) + "\n")
        try:
            os.link(temporary, path)  # never replaces a file another command made meanwhile
        except FileExistsError:
            pass
        finally:
            os.unlink(temporary)
    read_token_file(path)  # a file others may read is refused, not used
    return path


def new_token() -> str:
    return secrets.token_urlsafe(32)


def run_token() -> Optional[str]:
    """The token this process's calls carry and its services demand; None when auth is off or none is given."""
    if auth_disabled():
        return None
    token = os.environ.get(TOKEN_ENV, "").strip()
    if token:
        return token
    path = os.environ.get(TOKEN_FILE_ENV, "").strip()
    return _file_token(path) if path else None


_read_tokens: dict[str, tuple[tuple[int, int, int], str]] = {}  # path -> ((mtime, size, mode), its token)


def _file_token(path: str) -> str:
    """read_token_file(path), read again only when the file changed: every request of a client asks for it."""
    try:
        st = os.stat(path)
    except OSError:
        return read_token_file(path)  # its error, naming the path
    key = (st.st_mtime_ns, st.st_size, st.st_mode)
    cached = _read_tokens.get(path)
    if cached is None or cached[0] != key:
        cached = _read_tokens[path] = (key, read_token_file(path))
    return cached[1]


def service_token(service: str) -> Optional[str]:
    """The token a service started on its own (`areal-pipeline inference-server`, a trainer node) demands; None
    when auth is off. No token and auth on is an error: such a service would take requests from anyone."""
    if auth_disabled():
        return None
    token = run_token()
    if token is None:
        raise CredentialError(
            f"{service}: no credential. Every request to it must carry the run's token: give it as "
            f"{TOKEN_FILE_ENV}=<file, mode 0600> (or {TOKEN_ENV}) to this process and to the run, or set "
            f"{AUTH_ENV}=off to take requests from anyone who reaches it (docs/security.md)")
    return token


def output_dir_token_file(output_dir: str | Path) -> Path:
    """The token file of the runs of an output directory, where none is given."""
    return Path(output_dir).expanduser().resolve() / ".credentials" / "token"


def ensure_run_token(output_dir: Optional[str | Path] = None) -> Optional[str]:
    """For a command that starts services of its own: the token given, else that of `output_dir` (made there if
    it has none yet), else a new one; put in this process's environment, which every service and client it starts
    inherits. None when auth is off."""
    if auth_disabled():
        return None
    token = run_token()
    if token is not None:
        return token
    if output_dir is not None:
        path = write_token_file(output_dir_token_file(output_dir))
        os.environ[TOKEN_FILE_ENV] = str(path)
        return read_token_file(path)
    token = os.environ[TOKEN_ENV] = new_token()
    return token


def auth_headers() -> dict[str, str]:
    token = run_token()
    return {"Authorization": f"Bearer {token}"} if token else {}


def authorized(header: Optional[str], token: Optional[str]) -> bool:
    """Whether an Authorization header carries `token` (None: no credential is demanded), compared in constant
    time so that the time a refusal takes says nothing of how much of a guess was right."""
    if token is None:
        return True
    scheme, _, given = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(given.strip().encode(), token.encode())


UNAUTHORIZED_MESSAGE = ("missing or wrong credential: send the run's token as 'Authorization: Bearer <token>' "
                        f"({TOKEN_ENV} / {TOKEN_FILE_ENV})")


# ----- TLS ----------------------------------------------------------------------------------------------------


def _tls_file(name: str) -> Optional[str]:
    value = os.environ.get(name, "").strip()
    if value and not Path(value).is_file():
        raise CredentialError(f"{name}={value}: no such file")
    return value or None


def scheme() -> str:
    """The scheme of every service URL this process calls: https once it is given a CA bundle (or serves TLS)."""
    return "https" if (os.environ.get(TLS_CA_ENV, "").strip() or os.environ.get(TLS_CERT_ENV, "").strip()) \
        else "http"


def url(address: str, path: str = "") -> str:
    """`host:port` and a path as the URL this process calls it by."""
    return f"{scheme()}://{address}{path}"


def client_ssl_context() -> Optional[ssl.SSLContext]:
    """What a client checks the services' certificates against (None: plain HTTP); one per CA bundle, made once."""
    if scheme() != "https":
        return None
    return _client_context(_tls_file(TLS_CA_ENV))


@functools.lru_cache(maxsize=8)
def _client_context(cafile: Optional[str]) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=cafile)


def server_ssl_context() -> Optional[ssl.SSLContext]:
    """A service's TLS context from its certificate and key (None: plain HTTP); one without the other is an
    error, as is a key that does not match."""
    cert, key = _tls_file(TLS_CERT_ENV), _tls_file(TLS_KEY_ENV)
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise CredentialError(f"TLS needs both {TLS_CERT_ENV} and {TLS_KEY_ENV}; only "
                              f"{TLS_CERT_ENV if cert else TLS_KEY_ENV} is set")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as e:
        raise CredentialError(f"{TLS_CERT_ENV}={cert}, {TLS_KEY_ENV}={key}: cannot use them ({e})") from None
    return context


def opener() -> urllib.request.OpenerDirector:
    """urllib's opener for the run's services: straight to them (never through an http_proxy of the environment),
    over TLS with the CA bundle where one is given."""
    return _opener(client_ssl_context())


@functools.lru_cache(maxsize=8)
def _opener(context: Optional[ssl.SSLContext]) -> urllib.request.OpenerDirector:
    return urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=context))


def request(address: str, path: str, data: Optional[bytes] = None, method: Optional[str] = None,
            headers: Optional[dict[str, str]] = None) -> urllib.request.Request:
    """A urllib request to a service of the run, carrying the run's credential."""
    return urllib.request.Request(url(address, path), data=data, method=method,
                                  headers={**(headers or {}), **auth_headers()})
