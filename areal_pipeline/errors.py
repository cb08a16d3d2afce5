"""Which failures are worth retrying: the one classification behind every retry decision of the pipeline.

    if is_transient(error): retry, else fail at once with the error's own message

A *permanent* error is deterministic: the same inputs fail the same way again (a bad config value, a malformed
dataset row, a missing file, a request a server rejects as bad, a programming error). Retrying it only delays
the message and buries it under more tracebacks. A *transient* fault may pass: a refused or reset connection, a
timeout, a server or trainer process that died, an HTTP 5xx reply.

An error of an unknown kind counts as transient (it was retried before this module existed, and retries are
bounded), unless its explicit cause (`raise ... from cause`) says otherwise.
"""

from __future__ import annotations

import http.client
import subprocess

# Built-in errors that mean the inputs or the code are wrong, not the machine or the network.
_PERMANENT_BUILTINS: tuple[type[BaseException], ...] = (
    ValueError, TypeError, LookupError, AttributeError, NameError, AssertionError, NotImplementedError,
    ArithmeticError, ImportError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
    PermissionError,
)
_TRANSIENT_BUILTINS: tuple[type[BaseException], ...] = (
    ConnectionError, TimeoutError, EOFError, http.client.HTTPException, subprocess.TimeoutExpired,
    subprocess.CalledProcessError,  # a process that died
)
# HTTP 4xx replies that are about timing or the server's state, not about the request itself: the trainer at
# another version (409) is brought to the right one by the retry.
_RETRYABLE_CLIENT_STATUSES = frozenset({408, 409, 425, 429})


class PermanentError(Exception):
    """Base of the library's deterministic errors (ConfigError, DatasetError): retrying cannot help."""


def is_transient(error: BaseException) -> bool:
    """True for a fault that a retry may get past, False for a deterministic error (see the module doc)."""
    if isinstance(error, BaseExceptionGroup):
        # One deterministic member fails every retry the same way.
        return all(is_transient(member) for member in error.exceptions)
    if not isinstance(error, Exception):
        return False  # KeyboardInterrupt, SystemExit, cancellation: stopping, not failing
    if isinstance(error, (PermanentError, *_library_permanent_errors())):
        return False
    status = _http_status(error)
    if status is not None:
        return status >= 500 or status in _RETRYABLE_CLIENT_STATUSES
    if isinstance(error, _TRANSIENT_BUILTINS):
        return True
    if isinstance(error, _PERMANENT_BUILTINS):
        return False
    if error.__cause__ is not None:
        return is_transient(error.__cause__)
    return True


def _library_permanent_errors() -> tuple[type[BaseException], ...]:
    # The shards module keeps its RuntimeError base (callers catch it as such); a shard directory that fails its
    # manifest check fails it again on every retry. Imported here, when classifying, to keep this module light.
    from areal_pipeline.data.shards import ShardError

    return (ShardError,)


def _http_status(error: BaseException) -> int | None:
    """The HTTP status of an error reply (TrainerError, InferenceServerError, aiohttp and urllib errors all keep
    it as `status`); None when the error is not a reply (TrainerError says 0 for an unreachable trainer)."""
    status = getattr(error, "status", None)
    return status if isinstance(status, int) and 400 <= status < 600 else None
