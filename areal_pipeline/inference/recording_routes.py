"""The CPU server's traffic recording (issue #51): with `--record-dir DIR`, each chat completion it serves is
recorded, one record per choice, on disk before the reply is sent, and `POST /v1/feedback` takes its users' rewards:

    POST /v1/feedback {"response_id": "chatcmpl-..." or "conversation_id": "...", "reward": 1.0, "comment": "..."}
    -> 200 {"object": "feedback", "id": "fb-...", "response_id": ..., "conversation_id": ..., "reward": ...}

The files, their rotation and their recovery after a crash: areal_pipeline/online/traffic_log.py. The file I/O runs
on one writer thread, so appends keep their order and the event loop never waits on a disk; requests that finish
while a write is on disk are written together under the next fsync.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

from aiohttp import web

from areal_pipeline.http_json import RequestRejected, check_number, read_json_object, shown
from areal_pipeline.inference.openai_api import openai_errors
from areal_pipeline.inference.openai_errors import OpenAIError, error_body
from areal_pipeline.inference.openai_replies import Generation
from areal_pipeline.inference.openai_requests import ChatRequest
from areal_pipeline.online.traffic_log import (DEFAULT_ROTATE_BYTES, DEFAULT_ROTATE_S, KINDS, TrafficLog,
                                               prompt_sha256, writer_name)
from areal_pipeline.utils import get_logger

logger = get_logger(__name__)

FEEDBACK_BODY_FIELDS = ("response_id", "conversation_id", "reward", "comment")
MAX_COMMENT_CHARS = 4096
CONVERSATION_HEADER = "X-Conversation-Id"
ROTATION_CHECK_MAX_S = 60.0  # how often, at most, the age of the open journals is checked when no request comes
NOT_RECORDING = ("this server records no traffic, so it takes no feedback: start it with --record-dir DIR to "
                 "record chat completions and feedback")


class GroupCommit:
    """Appends to one TrafficLog from the event loop, in order, on the writer thread: the records of requests that
    come while a write is on disk go together under the next fsync."""

    def __init__(self, log: TrafficLog, executor: ThreadPoolExecutor):
        self.log, self.executor = log, executor
        self._pending: list[tuple[list[dict], asyncio.Future]] = []
        self._drain_task: Optional[asyncio.Task] = None

    async def append(self, records: list[dict]) -> None:
        """Return once the records are durable (the log's error otherwise)."""
        future = asyncio.get_running_loop().create_future()
        self._pending.append((records, future))
        if self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        await future

    async def _drain(self) -> None:
        loop, batch = asyncio.get_running_loop(), []
        try:
            while self._pending:
                batch, self._pending = self._pending, []
                try:
                    await loop.run_in_executor(self.executor, self.log.append_many,
                                               [r for records, _ in batch for r in records])
                except Exception as e:
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(e)
                else:
                    for _, future in batch:
                        if not future.done():
                            future.set_result(None)
        finally:  # cancelled at shutdown: no request waits for ever
            for _, future in batch + self._pending:
                if not future.done():
                    future.cancel()
            self._drain_task = None


class TrafficRecording:
    """The server's two logs (chat completions and feedback; `enabled` only with --record-dir), the feedback route,
    and the timer that seals journals by age. Constructing it seals the journals of servers that died and applies
    retention, as the server starts."""

    def __init__(self, server_args: dict[str, Any]):
        self.directory: Optional[str] = server_args.get("record_dir") or None
        self.enabled = self.directory is not None
        host, port = server_args.get("host", "127.0.0.1"), server_args.get("port", 0)
        self.server_address = f"{host}:{port}"
        self.rotate_s = float(server_args.get("record_rotate_s") or DEFAULT_ROTATE_S)
        self.logs: dict[str, TrafficLog] = {}
        self._commits: dict[str, GroupCommit] = {}
        self._timer: Optional[asyncio.Task] = None
        if not self.enabled:
            return
        self._writing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="traffic-log")
        writer = writer_name(host, port)
        for kind in KINDS:
            self.logs[kind] = TrafficLog(
                self.directory, kind, writer,
                rotate_bytes=int(server_args.get("record_rotate_bytes") or DEFAULT_ROTATE_BYTES),
                rotate_s=self.rotate_s, retention_days=float(server_args.get("record_retention_days") or 0.0))
            self._commits[kind] = GroupCommit(self.logs[kind], self._writing)
        logger.info("recording chat completions and feedback into %s (writer %s)", self.directory, writer)

    def register(self, app: web.Application) -> None:
        app.router.add_post("/v1/feedback", self.feedback)
        if self.enabled:
            app.on_startup.append(self._start_timer)
            app.on_cleanup.append(self._close)

    async def record_chat(self, request: web.Request, body: dict, chat: ChatRequest, prompt_ids: list[int],
                          generations: list[Generation], reply: dict[str, Any]) -> None:
        """Record each choice of a chat completion about to be answered; a failure to is the request's 500 (the
        reply is not sent: an answered request is a recorded one)."""
        conversation = ((body.get("metadata") or {}).get("conversation_id")
                        or request.headers.get(CONVERSATION_HEADER) or reply["id"])
        tools = body.get("tools")
        sampling = chat.sampling
        shared = {
            "response_id": reply["id"], "conversation_id": conversation, "created_at": time.time(),
            "server": self.server_address, "model": chat.model, "prompt_ids": list(prompt_ids),
            "messages": json.dumps(body["messages"], ensure_ascii=False),
            "tools": "" if tools is None else json.dumps(tools, ensure_ascii=False),
            "temperature": sampling.temperature, "top_p": sampling.top_p,
            "max_tokens": -1 if sampling.max_new_tokens is None else sampling.max_new_tokens,
            "prompt_sha256": prompt_sha256(prompt_ids),
        }  # fmt: skip
        records = [{**shared, "sample_id": f"{reply['id']}/{index}", "choice": index, "version": generation.version,
                    "completion_ids": list(generation.output_ids), "logprobs": list(generation.logprobs),
                    "versions": list(generation.versions), "finish_reason": choice["finish_reason"],
                    "reply": json.dumps(choice["message"], ensure_ascii=False)}
                   for index, (generation, choice) in enumerate(zip(generations, reply["choices"]))]
        await self._durably("requests", records)

    @openai_errors
    async def feedback(self, request: web.Request) -> web.Response:
        if not self.enabled:
            return web.json_response(error_body(NOT_RECORDING, code="not_found"), status=404)
        response_id, conversation_id, reward, comment = parse_feedback(await read_json_object(request))
        feedback_id = f"fb-{uuid.uuid4().hex}"
        await self._durably("feedback", [{
            "feedback_id": feedback_id, "response_id": response_id or "", "conversation_id": conversation_id or "",
            "reward": reward, "comment": comment, "received_at": time.time(), "server": self.server_address}])
        return web.json_response({"object": "feedback", "id": feedback_id, "response_id": response_id,
                                  "conversation_id": conversation_id, "reward": reward})

    async def _durably(self, kind: str, records: list[dict]) -> None:
        try:
            await self._commits[kind].append(records)
        except Exception as e:
            logger.exception("could not record %d %s record(s)", len(records), kind)
            raise OpenAIError(f"the server could not record the {kind[:-1] if kind == 'requests' else kind}: {e}",
                              code="internal_error", status=500, error_type="server_error") from None

    async def _start_timer(self, app: web.Application) -> None:
        self._timer = asyncio.get_running_loop().create_task(self._rotate_by_age())

    async def _rotate_by_age(self) -> None:
        """Seal journals that grew old without a request to notice (an append checks their age too)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(self.rotate_s, ROTATION_CHECK_MAX_S))
            for log in self.logs.values():
                try:
                    await loop.run_in_executor(self._writing, log.maybe_rotate)
                except Exception:  # the next tick, or the next append, tries again
                    logger.exception("could not rotate the %s traffic journal", log.kind)

    async def _close(self, app: web.Application) -> None:
        """Seal the open journals as the server stops (after the requests in flight are done or cancelled)."""
        if self._timer is not None:
            self._timer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer
        loop = asyncio.get_running_loop()
        for log in self.logs.values():
            try:
                await loop.run_in_executor(self._writing, log.close)
            except Exception:
                logger.exception("could not seal the %s traffic journal; the next start seals it", log.kind)
        self._writing.shutdown(wait=False)


def parse_feedback(body: dict) -> tuple[Optional[str], Optional[str], float, str]:
    """(response_id, conversation_id, reward, comment) of a /v1/feedback body, checked: OpenAIError naming the field."""
    unknown = sorted(set(body) - set(FEEDBACK_BODY_FIELDS))
    if unknown:
        raise OpenAIError(f"unknown field(s) {unknown}; valid: {', '.join(FEEDBACK_BODY_FIELDS)}", unknown[0],
                          "unknown_parameter")
    ids = {name: body[name] for name in ("response_id", "conversation_id") if body.get(name) is not None}
    if len(ids) != 1:
        raise OpenAIError(f"give exactly one of 'response_id' (a chat completion's id) or 'conversation_id' (as its "
                          f"request's metadata gave it), got {'both' if ids else 'neither'}",
                          "conversation_id" if ids else "response_id")
    for name, value in ids.items():
        if type(value) is not str or not value:
            raise OpenAIError(f"'{name}' must be a non-empty string, got {shown(value)}", name)
    if body.get("reward") is None:
        raise OpenAIError("'reward' is required: a finite number", "reward")
    try:
        reward = check_number("reward", body["reward"])
    except RequestRejected as e:
        raise OpenAIError(str(e), "reward") from None
    comment = body.get("comment")
    comment = "" if comment is None else comment
    if type(comment) is not str or len(comment) > MAX_COMMENT_CHARS:
        raise OpenAIError(f"'comment' must be a string of at most {MAX_COMMENT_CHARS} characters, got "
                          f"{shown(comment)}" + (f" ({len(comment)} characters)" if type(comment) is str else ""),
                          "comment")
    return ids.get("response_id"), ids.get("conversation_id"), reward, comment
