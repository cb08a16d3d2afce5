"""Checks of the OpenAI request fields that `openai_api.py` takes without using them, and of the token budget
fields: a wrong-typed value is refused with HTTP 400 naming the field (as OpenAI refuses it), never taken silently.
The error they raise, OpenAIError (OpenAI's error shape), is defined here, below `openai_api.py`, which uses it too.
"""

from __future__ import annotations

from typing import Any, Optional

from areal_pipeline.http_json import RequestRejected, shown


class OpenAIError(RequestRejected):
    """A request answered in OpenAI's error shape (HTTP 400 unless given)."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None, status: int = 400,
                 error_type: str = "invalid_request_error"):
        super().__init__(message, status)
        self.param, self.code, self.error_type = param, code, error_type

    def body(self) -> dict:
        return error_body(str(self), self.error_type, self.param, self.code)


def error_body(message: str, error_type: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _refused(message: str, param: str) -> RequestRejected:
    return OpenAIError(message, param)


def check_unused_fields(body: dict) -> None:
    """`user`, `service_tier` (strings), `store` (a boolean), `metadata` (an object of strings) and
    `stream_options` (an object): taken, as they do not change a generation, when null or of OpenAI's type."""
    for name in ("user", "service_tier"):
        if body.get(name) is not None and type(body[name]) is not str:
            raise _refused(f"'{name}' must be a string, got {shown(body[name])}", name)
    if body.get("store") is not None and type(body["store"]) is not bool:
        raise _refused(f"'store' must be true or false, got {shown(body['store'])}", "store")
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(type(v) is str for v in metadata.values())):
        raise _refused(f"'metadata' must be an object of strings, got {shown(metadata)}", "metadata")
    if body.get("stream_options") is not None and not isinstance(body["stream_options"], dict):
        raise _refused(f"'stream_options' must be an object, got {shown(body['stream_options'])}", "stream_options")


def given_max_tokens(body: dict) -> tuple[str, Optional[int]]:
    """(the field that sets the budget, its value; None where neither `max_completion_tokens` nor `max_tokens` is
    given): each an integer >= 1, and both, where given, the same."""
    given = {}
    for name in ("max_tokens", "max_completion_tokens"):
        value: Any = body.get(name)
        if value is not None:
            if type(value) is not int or value < 1:
                raise _refused(f"'{name}' must be an integer >= 1, got {shown(value)}", name)
            given[name] = value
    if len(set(given.values())) > 1:
        raise _refused(f"max_tokens={given['max_tokens']} and max_completion_tokens="
                       f"{given['max_completion_tokens']} disagree: give one", "max_completion_tokens")
    if "max_completion_tokens" in given:
        return "max_completion_tokens", given["max_completion_tokens"]
    return "max_tokens", given.get("max_tokens")
