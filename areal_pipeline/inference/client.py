"""Async client for inference servers speaking SGLang's HTTP API (a real SGLang server or the CPU server).

    engine = RemoteSGLangEngine(["127.0.0.1:30000", "127.0.0.1:30001"])
    await engine.wait_healthy(300)
    resp = await engine.agenerate(ModelRequest(input_ids=ids, sampling=SamplingParams.from_config(gconfig)))
    await engine.update_weights(checkpoint_dir, version=1)  # pause -> load -> set version -> resume
    await engine.close()

Generation is interruptible, as in AReaL's RemoteSGLangEngine: a weight update pauses the servers, which
return running requests early with `finish_reason.type == "abort"`; `agenerate` then re-sends the prompt
plus the tokens so far with the remaining budget, so one trajectory can mix policy versions.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import threading
import time
from collections import OrderedDict
from typing import Any, Optional

import aiohttp

from areal_pipeline import auth, shutdown
from areal_pipeline.config import InferenceConfig
from areal_pipeline.inference.adapters import ServedAdapter, not_loaded, push_adapter
from areal_pipeline.inference.server_error import InferenceServerError
from areal_pipeline.inference.types import ModelRequest, ModelResponse, SamplingParams
from areal_pipeline.utils import PeerTimeout, get_logger

logger = get_logger(__name__)

RID_CACHE_SIZE = 128
# How often an interrupted request checks whether it may be re-sent: while this client has paused the
# servers it waits locally rather than queue on them.
_PAUSE_POLL_S = 0.05


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _error_message(text: str) -> str:
    """The server's own words: SGLang answers `{"error": {"message": ...}}`, FastAPI `{"detail": ...}`."""
    body = _json_or_text(text)
    if isinstance(body, dict):
        for key in ("error", "detail", "message"):
            value = body.get(key)
            if isinstance(value, dict) and "message" in value:
                return str(value["message"])
            if value:
                return str(value)
    return text.strip()[:2000] or "<empty body>"


@dataclasses.dataclass
class _Sample:
    """One sample's progress across the rounds of `agenerate_group`."""
    req: ModelRequest
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    stop_reason: str = "abort"  # not started counts as interrupted

    @property
    def unfinished(self) -> bool:
        return self.stop_reason == "abort" and len(self.tokens) < self.req.sampling.max_new_tokens


@dataclasses.dataclass
class _Segment:
    """What one round of generation added to a sample; stop_reason "abort": interrupted, to be resumed."""
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    stop_reason: str


class RemoteSGLangEngine:
    backend = "sglang"  # the protocol spoken (the project's server speaks SGLang's)

    def __init__(
        self,
        addresses: list[str],
        *,
        request_timeout: float = 3600.0,
        request_retries: int = 3,
        retry_delay: float = 1.0,
        setup_timeout: float = 300.0,
        context_length: Optional[int] = None,
        pause_timeout: float = 600.0,
        adapter: Optional[ServedAdapter] = None,
        kind: Optional[str] = None,
    ):
        """`context_length`: the servers' (where known): a generation's budget is cut to what fits below it, as
        SGLang refuses prompt + max_new_tokens reaching it. `pause_timeout`: how long a request waits for the
        `resume` that follows this client's `pause` (inference.pause_timeout) before it fails naming the server.
        `adapter`: the LoRA adapter the servers serve the policy as (adapters.py; trainer.lora.push): every request
        and probe names it, and a weight update loads a PEFT adapter directory as the next one. `kind`: the backend
        the servers are (inference.backend: "cpu" or "sglang"), as errors name it."""
        if not addresses:
            raise ValueError("RemoteSGLangEngine needs at least one server address")
        self.addresses = list(addresses)
        self.request_timeout = request_timeout
        self.request_retries = request_retries
        self.retry_delay = retry_delay
        self.setup_timeout = setup_timeout
        self.context_length = context_length
        if pause_timeout <= 0:
            raise ValueError(f"pause_timeout must be positive, got {pause_timeout}")
        self.pause_timeout = pause_timeout
        self.adapter = adapter
        self.kind = kind or self.backend
        self._version = 0
        self._paused = False
        # Rollouts may run on several event loops (threads); an aiohttp session belongs to one loop.
        self._sessions: dict[asyncio.AbstractEventLoop, aiohttp.ClientSession] = {}
        self._lock = threading.Lock()
        self._next_server = random.randrange(len(self.addresses))
        self._rid_to_server: OrderedDict[str, str] = OrderedDict()

    @classmethod
    def from_config(cls, addresses: list[str], cfg: InferenceConfig) -> "RemoteSGLangEngine":
        served_by_sglang = cfg.backend == "sglang" or bool(cfg.addresses)
        return cls(addresses, request_timeout=cfg.request_timeout, request_retries=cfg.request_retries,
                   setup_timeout=cfg.setup_timeout, pause_timeout=cfg.pause_timeout,
                   context_length=cfg.sglang.context_length if served_by_sglang else cfg.context_length)

    async def __aenter__(self) -> "RemoteSGLangEngine":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # -- versions and server choice ---------------------------------------------------------------

    def set_version(self, version: int) -> None:
        self._version = int(version)

    def get_version(self) -> int:
        return self._version

    def choose_server(self, rid: Optional[str] = None) -> str:
        """Round robin; a known `rid` keeps its server so later turns reuse the KV prefix cache."""
        with self._lock:
            if rid is not None and rid in self._rid_to_server:
                self._rid_to_server.move_to_end(rid)
                return self._rid_to_server[rid]
            address = self.addresses[self._next_server]
            self._next_server = (self._next_server + 1) % len(self.addresses)
            if rid is not None:
                self._remember(rid, address)
            return address

    def _remember(self, rid: str, address: str) -> None:
        """Keep `rid` on `address` (least recently used rids are forgotten); call with the lock held."""
        self._rid_to_server[rid] = address
        if len(self._rid_to_server) > RID_CACHE_SIZE:
            self._rid_to_server.popitem(last=False)

    # -- HTTP -------------------------------------------------------------------------------------

    def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._sessions.get(loop)
        if session is None or session.closed:
            with self._lock:
                for other in [l for l in self._sessions if l.is_closed()]:
                    self._sessions.pop(other, None)
            # No connection limit: dozens of concurrent episodes must not queue inside the client.
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ssl=auth.client_ssl_context() or True)
            session = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=self.request_timeout),
                headers=auth.auth_headers(),
            )
            self._sessions[loop] = session
        return session

    async def close(self) -> None:
        """Close the calling event loop's session; call it from every loop that used the engine."""
        session = self._sessions.pop(asyncio.get_running_loop(), None)
        if session is not None:
            await session.close()

    async def request(
        self,
        address: str,
        endpoint: str,
        payload: Optional[dict] = None,
        method: str = "POST",
        timeout: Optional[float] = None,
        retries: Optional[int] = None,
    ) -> Any:
        """One JSON call. Connection errors, timeouts and 5xx are retried with exponential backoff; 4xx are not."""
        retries = self.request_retries if retries is None else retries
        client_timeout = aiohttp.ClientTimeout(total=timeout or self.request_timeout)
        url = auth.url(address, endpoint)
        last_error, attempts = "", 0
        for attempt in range(retries + 1):
            if attempt and shutdown.requested_by() is not None:
                break  # the run is stopping (its servers with it): a retry could only wait for nothing
            if attempt:
                delay = self.retry_delay * 2 ** (attempt - 1)
                logger.warning("%s%s failed (%s); retry %d/%d in %.1fs", address, endpoint, last_error, attempt,
                               retries, delay)
                await asyncio.sleep(delay)
            attempts += 1
            try:
                async with self._session().request(method, url, json=payload, timeout=client_timeout) as resp:
                    text = await resp.text()
                    if resp.status < 400:
                        return _json_or_text(text)
                    last_error = f"HTTP {resp.status}: {_error_message(text)}"
                    if resp.status < 500:
                        raise InferenceServerError(address, endpoint, last_error, resp.status)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                last_error = f"{type(e).__name__}: {e}"
        raise InferenceServerError(address, endpoint, f"failed after {attempts} attempts; last error: {last_error}")

    async def _all(self, endpoint: str, payload: Optional[dict] = None, method: str = "POST") -> list[Any]:
        return list(await asyncio.gather(*(self.request(a, endpoint, payload, method) for a in self.addresses)))

    # -- generation -------------------------------------------------------------------------------

    def _generate_payload(self, req: ModelRequest, generated: list[int]) -> dict:
        max_new_tokens = req.sampling.max_new_tokens - len(generated)
        if self.context_length:
            room = self.context_length - 1 - len(req.input_ids) - len(generated)
            if room >= 1:  # else the server's refusal says the prompt alone is too long
                max_new_tokens = min(max_new_tokens, room)
        # No `rid`: the trajectory's id only keeps it on one server (choose_server). SGLang 0.5.10 refuses an id it
        # still holds (an aborted request's may linger), so an id re-sent after a pause could fail the request;
        # the server makes one per request, as for AReaL's client, which sends none either.
        return {
            "input_ids": list(req.input_ids) + generated,
            "sampling_params": dataclasses.replace(req.sampling, max_new_tokens=max_new_tokens).sglang(),
            "return_logprob": True,
            "stream": False,
            **self._lora_path(),
        }

    def _lora_path(self) -> dict:
        name = self.adapter.name if self.adapter is not None else None
        return {"lora_path": name} if name else {}

    def _context_full(self, sample: _Sample) -> bool:
        """Whether `sample` has reached the servers' context length (where known): its prompt and tokens so far fit,
        but not one more token below the limit, which SGLang requires."""
        used = len(sample.req.input_ids) + len(sample.tokens)
        return bool(self.context_length) and used < self.context_length <= used + 1

    def _segment_version(self, meta: dict) -> int:
        try:
            return int(meta.get("weight_version"))
        except (TypeError, ValueError):
            return self.get_version()

    async def _generate_round(self, address: str, pending: list[_Sample]) -> list[_Segment]:
        """One round of generation for the samples not finished yet: each one's new tokens (its prompt plus what
        it has so far as input, its remaining budget), with their logprobs and versions, and why it stopped."""
        payloads = [self._generate_payload(s.req, s.tokens) for s in pending]
        try:
            if len(payloads) == 1:
                replies = [await self.request(address, "/generate", payloads[0])]
            else:
                batch = {key: [p[key] for p in payloads] for key in ("input_ids", "sampling_params")}
                replies = await self.request(address, "/generate", {**payloads[0], **batch})
        except InferenceServerError as e:
            # sent naming the adapter a push has just replaced: interrupted, as by the push's pause, and resent
            if not_loaded(e) and payloads[0].get("lora_path") != self._lora_path().get("lora_path"):
                return [_Segment([], [], [], "abort") for _ in pending]
            raise
        segments = []
        for reply in replies:
            meta = reply["meta_info"]
            entries = meta.get("output_token_logprobs") or []
            segments.append(_Segment(tokens=[int(t) for _, t, *_ in entries],
                                     logprobs=[float(lp) for lp, *_ in entries],
                                     versions=[self._segment_version(meta)] * len(entries),
                                     stop_reason=(meta.get("finish_reason") or {}).get("type") or "stop"))
        return segments

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate one sample, resuming across interruptions until it stops or uses its whole budget."""
        return (await self.agenerate_group([req]))[0]

    async def agenerate_group(self, reqs: list[ModelRequest]) -> list[ModelResponse]:
        """Generate several samples (e.g. a GRPO group) on one server, as `agenerate` does for each, in one
        `/generate` call per round: SGLang's batch form (lists of `input_ids` and `sampling_params`) costs
        one HTTP request instead of one per sample. Samples interrupted by a pause resume together."""
        for req in reqs:
            if req.sampling.max_new_tokens is None or req.sampling.max_new_tokens <= 0:
                raise ValueError(f"max_new_tokens must be positive, got {req.sampling.max_new_tokens}")
        address = self.choose_server(reqs[0].rid)
        if len(reqs) > 1:
            with self._lock:
                for req in reqs[1:]:
                    self._remember(req.rid, address)
        samples = [_Sample(req) for req in reqs]
        start = time.perf_counter()
        while pending := [s for s in samples if s.unfinished]:
            for sample in [s for s in pending if self._context_full(s)]:
                sample.stop_reason = "length"  # SGLang refuses a request that leaves no room to generate in
            if not (pending := [s for s in pending if s.unfinished]):
                break
            await self._wait_resumed(address)
            empty_abort = False
            for sample, segment in zip(pending, await self._generate_round(address, pending)):
                sample.stop_reason = segment.stop_reason
                sample.tokens.extend(segment.tokens)
                sample.logprobs.extend(segment.logprobs)
                sample.versions.extend(segment.versions)
                empty_abort |= sample.stop_reason == "abort" and not segment.tokens
            if empty_abort:
                # Aborted before prefill (a pause raced with the send): don't spin on the server.
                await asyncio.sleep(_PAUSE_POLL_S)
        latency = time.perf_counter() - start
        return [ModelResponse(
            input_tokens=list(s.req.input_ids),
            output_tokens=s.tokens,
            output_logprobs=s.logprobs,
            output_versions=s.versions,
            stop_reason="length" if s.stop_reason == "abort" else s.stop_reason,
            latency=latency,
            server=address,
        ) for s in samples]

    async def _wait_resumed(self, address: str) -> None:
        """Wait while this client has the servers paused; an orchestrator that never resumes them (it hung, or
        died between pause and resume) must not hold the rollout for good."""
        limit = time.monotonic() + self.pause_timeout
        while self._paused:
            if time.monotonic() > limit:
                raise PeerTimeout(f"server {address}", "resume from the orchestrator after a pause",
                                  self.pause_timeout)
            await asyncio.sleep(_PAUSE_POLL_S)

    # -- control and weight updates ---------------------------------------------------------------

    async def pause(self) -> None:
        """Stop generation on every server; running requests come back early and wait for `resume`."""
        self._paused = True
        await self._all("/pause_generation", {"mode": "abort"})

    async def resume(self) -> None:
        try:
            await self._all("/continue_generation", {})
        finally:
            self._paused = False

    async def update_weights_from_disk(self, path: str, version: int) -> None:
        """Load a Hugging Face checkpoint directory on every server, then tag new tokens with `version`; with an
        `adapter`, a PEFT adapter directory as the next adapter (adapters.push_adapter)."""
        if self.adapter is not None:
            await push_adapter(self, str(path), version, self.kind)
            return
        payload = {
            "model_path": str(path),
            "weight_version": str(version),
            "abort_all_requests": False,
            "flush_cache": True,
        }
        replies = await self._all("/update_weights_from_disk", payload)
        for address, reply in zip(self.addresses, replies):
            if not (isinstance(reply, dict) and reply.get("success")):
                message = reply.get("message") if isinstance(reply, dict) else reply
                raise InferenceServerError(address, "/update_weights_from_disk", f"weight update failed: {message}")
        self.set_version(version)

    async def update_weights(self, path: str, version: int) -> None:
        """AReaL's order: pause -> update -> set version -> resume. Servers are resumed even if loading fails."""
        try:
            await self.pause()
            await self.update_weights_from_disk(path, version)
        finally:
            await self.resume()

    # -- health and info --------------------------------------------------------------------------

    async def wait_healthy(self, timeout: Optional[float] = None) -> None:
        """Poll `GET /health` on every server until all answer 200."""
        timeout = self.setup_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        pending = set(self.addresses)
        while True:
            for address in sorted(pending):
                try:
                    await self.request(address, "/health", method="GET", timeout=10, retries=0)
                    pending.discard(address)
                except InferenceServerError:
                    pass
            if not pending:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"inference servers not healthy after {timeout:.0f}s: {', '.join(sorted(pending))}")
            await asyncio.sleep(0.5)

    async def probe_logprobs(self, address: str, input_ids: list[int]) -> list[float]:
        """The server's logprob of each of `input_ids[1:]` after the ids before it, at temperature 1: what the
        trainer computes for the same ids, to check which weights the server holds."""
        payload = {"input_ids": list(input_ids), "sampling_params": SamplingParams(max_new_tokens=1).sglang(),
                   "return_logprob": True, "logprob_start_len": 0, "stream": False, **self._lora_path()}
        entries = (await self.request(address, "/generate", payload))["meta_info"].get("input_token_logprobs") or []
        values = [entry[0] for entry in entries]
        if values and values[0] is None:  # the first token has no logprob
            values = values[1:]
        if len(values) != len(input_ids) - 1:
            raise InferenceServerError(address, "/generate", f"asked for the logprobs of {len(input_ids) - 1} prompt "
                                       f"tokens, got {len(values)}")
        return [float(v) for v in values]

    async def get_model_info(self, address: Optional[str] = None) -> dict:
        # /model_info and /server_info: SGLang logs a deprecation warning for each /get_... call
        return await self.request(address or self.addresses[0], "/model_info", method="GET")

    async def get_server_info(self, address: Optional[str] = None) -> dict:
        return await self.request(address or self.addresses[0], "/server_info", method="GET")

