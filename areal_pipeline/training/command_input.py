"""What the trainer's `POST /command` takes: a JSON object of at most MAX_COMMAND_BYTES, whose arguments match the
command handler's signature and annotations. A command that fails these checks is refused with a 4xx naming the
argument, before any rank starts on it; the pipeline does not retry a 4xx, while it retries a 500."""

from __future__ import annotations

import inspect
import json
import math
import types
import typing
from typing import Any, Callable, Optional, Union

# Commands are small (paths, addresses, a probe's token ids): a body beyond this is refused unread.
MAX_COMMAND_BYTES = 16 << 20
# A client that declares more body than it sends must not hold a handler thread for ever.
BODY_READ_TIMEOUT_S = 60.0


def read_command(headers, rfile, limit: int = MAX_COMMAND_BYTES) -> tuple[Optional[dict], Optional[tuple[int, str]]]:
    """(the command, None), or (None, (status, why)) for a body that is not one."""
    declared = headers.get("Content-Length")
    if declared is None:
        return None, (411, "a command needs a Content-Length header (a JSON object as the body)")
    if not declared.strip().isdigit():
        return None, (400, f"bad command: Content-Length {declared!r} is not a byte count")
    size = int(declared)
    if size > limit:
        return None, (413, f"bad command: the body has {size} bytes; the limit is {limit}")
    try:
        raw = rfile.read(size)
    except OSError as e:  # the read timed out or the connection broke
        return None, (400, f"bad command: the body could not be read: {e}")
    if len(raw) < size:
        return None, (400, f"bad command: the body ended after {len(raw)} of {size} bytes")
    try:
        command = json.loads(raw or b"{}")
    except ValueError as e:
        return None, (400, f"bad command: the body is not JSON: {e}")
    except RecursionError:
        return None, (400, "bad command: the body is JSON nested too deeply to read")
    if not isinstance(command, dict):
        return None, (400, f"bad command: a command is a JSON object, not {type(command).__name__}")
    return command, None


def check_arguments(name: str, handler: Callable, args: dict[str, Any]) -> None:
    """ValueError naming the argument where `args` do not fit `handler`: unknown or missing ones, or a value not of
    the annotated type (ints are not bools; floats are finite)."""
    signature = inspect.signature(handler)
    unknown = sorted(set(args) - set(signature.parameters))
    if unknown:
        raise ValueError(f"unknown argument(s) {unknown}; valid: {sorted(signature.parameters)}")
    missing = [p for p, spec in signature.parameters.items() if spec.default is inspect.Parameter.empty
               and p not in args]
    if missing:
        raise ValueError(f"missing argument(s) {missing}")
    hints = typing.get_type_hints(handler)
    for arg, value in args.items():
        hint = hints.get(arg, Any)
        if not _matches(value, hint):
            raise ValueError(f"'{arg}' must be {_described(hint)}, got {_shown(value)}")


def _matches(value: Any, hint: Any) -> bool:
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    origin, params = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return any(_matches(value, p) for p in params)
    if origin is list:
        return isinstance(value, list) and all(_matches(v, params[0]) for v in value)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    if hint is int:
        return type(value) is int
    if hint is float:
        return type(value) in (int, float) and math.isfinite(value)
    if hint is bool:
        return type(value) is bool
    if hint is str:
        return type(value) is str
    return True  # a type this module does not know: the handler checks it


_NAMES = {int: ("an integer", "integers"), float: ("a finite number", "finite numbers"), str: ("a string", "strings"),
          bool: ("true or false", "booleans"), dict: ("an object", "objects"), type(None): ("null", "nulls")}


def _described(hint: Any, plural: bool = False) -> str:
    origin, params = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return " or ".join(_described(p, plural) for p in params)
    if origin is list:
        return ("lists" if plural else "a list") + " of " + _described(params[0], plural=True)
    names = _NAMES.get(origin or hint)
    return str(hint) if names is None else names[plural]


def _shown(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
