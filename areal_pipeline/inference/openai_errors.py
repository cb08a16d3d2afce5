"""OpenAI's error shape, for the OpenAI routes and request checks (openai_*.py, request_validation.py)."""

from __future__ import annotations

from typing import Optional

from areal_pipeline.http_json import RequestRejected


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


def as_openai_error(error: RequestRejected) -> OpenAIError:
    """An error of the shared request checks (http_json, the engine) as an OpenAI error: 400, or 413 for a body too
    large (a body that is not JSON, 415 on SGLang's native routes, is a 400 here as it is at OpenAI)."""
    if isinstance(error, OpenAIError):
        return error
    status = 413 if error.status == 413 else 400
    code = "context_length_exceeded" if "maximum context length" in str(error) else None
    return OpenAIError(str(error), code=code, status=status)
