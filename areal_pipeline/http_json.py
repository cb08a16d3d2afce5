"""JSON requests for the project's aiohttp servers (the CPU inference server and the retrieval server).

    app = web.Application(client_max_size=max_body_bytes, middlewares=[bearer_auth(token), json_errors])
    body = await read_json_object(request)                        # {} when the request has no body
    topk = check_int("topk", body.get("topk", 3), minimum=1, maximum=50)

A request the server will not take raises `RequestRejected`, which `json_errors` answers with its status and
SGLang's error shape `{"error": {"message": ...}}`: 413 for a body over the app's `client_max_size`, 415 for a
body that is not JSON, 400 for JSON the endpoint cannot use. Anything else that fails is logged and answered 500.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any, Optional

from aiohttp import hdrs, web

from areal_pipeline.auth import LIVENESS_PATH, UNAUTHORIZED_MESSAGE, authorized
from areal_pipeline.utils import get_logger

logger = get_logger(__name__)

# A body bigger than this is parsed on a worker thread, so that the server's other clients (a /health poll)
# are not kept waiting while it is: a large batch of token ids takes long enough to parse to stall them.
PARSE_ON_THREAD_BYTES = 1 << 20


class RequestRejected(ValueError):
    """A request answered with an HTTP 4xx status (400 unless given) and a message saying why."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def error_response(message: str, status: int) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


@web.middleware
async def json_errors(request: web.Request, handler):
    try:
        return await handler(request)
    except RequestRejected as e:
        return error_response(str(e), e.status)
    except web.HTTPException:
        raise
    except Exception as e:
        logger.exception("error serving %s", request.path)
        return error_response(f"internal error: {e}", 500)


def bearer_auth(token: Optional[str]):
    """A middleware that answers 401 to any request without `token` (None: every request passes), but a GET of
    the bare liveness probe. It runs before anything reads the request's body."""

    @web.middleware
    async def check_credential(request: web.Request, handler):
        if token is None or (request.method in ("GET", "HEAD") and request.path == LIVENESS_PATH) or authorized(
                request.headers.get(hdrs.AUTHORIZATION), token):
            return await handler(request)
        response = web.json_response({"error": {"message": UNAUTHORIZED_MESSAGE, "type": "invalid_request_error",
                                                "code": "invalid_api_key"}}, status=401)
        response.headers[hdrs.WWW_AUTHENTICATE] = "Bearer"
        return response

    return check_credential


def _is_json_media_type(media_type: str) -> bool:
    kind, _, subtype = media_type.lower().partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def _int_letting_other_threads_run(digits: str) -> int:
    # json's C scanner holds the GIL for a whole parse, worker thread or not (a /health poll waited behind a large
    # body of ids): running Python code for each integer lets the event loop take its turn, at the price of a
    # slower parse, paid only by bodies above PARSE_ON_THREAD_BYTES.
    return int(digits)


def _parse(raw: bytes, on_thread: bool = False) -> Any:
    try:
        return json.loads(raw, parse_int=_int_letting_other_threads_run) if on_thread else json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestRejected(f"the request body is not valid JSON: {e}", 415) from None
    except RecursionError:
        raise RequestRejected("the request body is JSON nested too deeply to read") from None
    except ValueError as e:  # an integer of more than 4300 digits
        raise RequestRejected(f"the request body holds a number that cannot be read: {e}") from None


async def read_json(request: web.Request) -> Any:
    """The request's JSON body; None when it has none. A body is taken when it declares no Content-Type or a
    JSON one (as SGLang's FastAPI does): a form or text body is a 415."""
    if not request.body_exists:
        return None
    declared = request.headers.get(hdrs.CONTENT_TYPE)
    if declared is not None and not _is_json_media_type(request.content_type):
        raise RequestRejected(f"the request body must be JSON (Content-Type: application/json), not {declared!r}",
                              415)
    limit = request.client_max_size
    # A declared size over the limit is refused before any of it is read.
    if request.content_length is not None and request.content_length > limit:
        raise RequestRejected(f"the request body has {request.content_length} bytes; the limit is {limit}", 413)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:  # a body sent without Content-Length, or with a false one
        raise RequestRejected(f"the request body has more than {limit} bytes; the limit is {limit}", 413) from None
    if not raw:
        return None
    if len(raw) > PARSE_ON_THREAD_BYTES:
        return await asyncio.to_thread(_parse, raw, True)
    return _parse(raw)


async def read_json_object(request: web.Request) -> dict:
    """The request's JSON body, which must be an object; {} when the request has no body."""
    body = await read_json(request)
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise RequestRejected(f"the request body must be a JSON object, not {type(body).__name__}")
    return body


# ----- field checks: the messages name the field and show (the start of) the value given ----------------------


def shown(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def check_int(name: str, value: Any, minimum: Optional[int] = None, maximum: Optional[int] = None) -> int:
    """`value` as an integer within [minimum, maximum] (bools and floats are refused)."""
    if minimum is not None and maximum is not None:
        wanted = f"an integer in [{minimum}, {maximum}]"
    elif minimum is not None:
        wanted = f"an integer >= {minimum}"
    elif maximum is not None:
        wanted = f"an integer <= {maximum}"
    else:
        wanted = "an integer"
    if (type(value) is not int or (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)):
        raise RequestRejected(f"'{name}' must be {wanted}, got {shown(value)}")
    return value


def check_number(name: str, value: Any) -> float:
    """`value` as a finite float (JSON numbers; NaN, Infinity and numbers beyond a double are refused)."""
    if type(value) in (int, float):
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        if math.isfinite(number):
            return number
    raise RequestRejected(f"'{name}' must be a finite number, got {shown(value)}")


def check_bool(name: str, value: Any) -> bool:
    if type(value) is not bool:
        raise RequestRejected(f"'{name}' must be true or false, got {shown(value)}")
    return value


def check_str(name: str, value: Any) -> str:
    if type(value) is not str:
        raise RequestRejected(f"'{name}' must be a string, got {shown(value)}")
    return value
