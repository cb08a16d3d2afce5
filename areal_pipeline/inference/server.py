"""The CPU inference server: SGLang's native HTTP API (the subset in sglang-protocol.md) on transformers.

    python -m areal_pipeline.inference.server --model PATH --host 127.0.0.1 --port 30000

A client written for a real SGLang server works against it unchanged, and so does one written for the OpenAI API
(`/v1/...`, see openai_api.py). Generation runs in `BatchEngine`, which decodes all concurrent requests together.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import torch
from aiohttp import web

from areal_pipeline import __version__
from areal_pipeline.auth import CredentialError, authorized, server_ssl_context, service_token
from areal_pipeline.http_json import (
    check_bool,
    check_int,
    check_str,
    bearer_auth,
    error_response,
    json_errors,
    read_json_object,
    shown,
)
from areal_pipeline.inference.engine import BatchEngine, RequestError
from areal_pipeline.inference.kv_batch import GenRequest
from areal_pipeline.inference.lora_serving import LoRARoutes, lora_path_names
from areal_pipeline.inference.openai_api import OpenAIRoutes
from areal_pipeline.inference.recording_routes import TrafficRecording
from areal_pipeline.inference.server_args import DEFAULT_MAX_BODY_BYTES, build_arg_parser
from areal_pipeline.inference.types import SamplingParams
from areal_pipeline.inference.weight_routes import WeightRoutes
from areal_pipeline.placement import gpu_uuid
from areal_pipeline.utils import exit_when_parent_dies, get_logger

logger = get_logger(__name__)

GENERATE_KEYS = {"input_ids", "text", "sampling_params", "return_logprob", "logprob_start_len",
                 "top_logprobs_num", "return_text_in_logprobs", "rid", "stream", "lora_path"}


def _given(body: dict, key: str, default: Any) -> Any:
    """`body[key]`, or `default` when it is absent or null (SGLang's optional fields take null)."""
    value = body.get(key)
    return default if value is None else value


class InferenceServer:
    def __init__(self, engine: BatchEngine, server_args: dict[str, Any], max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 token: Optional[str] = None):
        self.engine = engine
        self.token = token  # what every request but the liveness probe must carry (None: no credential asked)
        self.health_check_timeout = float(server_args.get("health_check_timeout", 20.0))
        self.server_args = server_args
        self.max_body_bytes = max_body_bytes
        self._in_flight: set[str] = set()  # the request ids clients gave of the requests running
        # Text prompts are tokenised here, one at a time (a tokenizer is not safe to reconfigure from two threads),
        # never on the event loop: a long one would hold up every other client, /health included.
        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        # with --record-dir: the chat completions served and the feedback taken (recording_routes.py); made here, as
        # the server starts, it seals the journals a killed server left
        self.recording = TrafficRecording(server_args)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.max_body_bytes, middlewares=[bearer_auth(self.token), json_errors])
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, self.model_info)
        for path in ("/get_server_info", "/server_info"):
            r.add_get(path, self.server_info)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        weights = WeightRoutes(self)
        weights.register(r)  # /update_weights_from_disk, the weight-update group's routes (weight_routes.py)
        LoRARoutes(self, weights.disk_refusal).register(r)  # /load_lora_adapter, /unload_lora_adapter
        OpenAIRoutes(self).register(r)  # /v1/chat/completions, /v1/completions, /v1/models (openai_api.py)
        self.recording.register(app)  # /v1/feedback, and the logs sealed at cleanup
        app.on_shutdown.append(self._shutdown)
        return app

    async def _shutdown(self, app) -> None:
        self._tokenizing.shutdown(wait=False, cancel_futures=True)
        await asyncio.get_running_loop().run_in_executor(None, self.engine.shutdown)

    def _require_ready(self) -> Optional[web.Response]:
        if self.engine.load_error is not None:
            return error_response(f"model failed to load: {self.engine.load_error}", 503)
        if not self.engine.ready.is_set():
            return error_response("the server is starting", 503)
        return None

    # ----- generation ------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        if (not_ready := self._require_ready()) is not None:
            return not_ready
        body = await read_json_object(request)
        unknown = set(body) - GENERATE_KEYS
        if unknown:
            raise RequestError(f"unknown field(s) {sorted(unknown)}; valid: {sorted(GENERATE_KEYS)}")
        if check_bool("stream", _given(body, "stream", False)):
            raise RequestError("stream=true is not supported by the CPU server; send stream=false")
        if check_int("top_logprobs_num", _given(body, "top_logprobs_num", 0), minimum=0):
            raise RequestError("top_logprobs_num > 0 is not supported by the CPU server")
        return_logprob = check_bool("return_logprob", _given(body, "return_logprob", False))
        logprob_start_len = check_int("logprob_start_len", _given(body, "logprob_start_len", -1), minimum=-1)
        with_text = check_bool("return_text_in_logprobs", _given(body, "return_text_in_logprobs", False))
        given, batched, are_texts = self._prompts(body)
        params = self._sampling_params(body.get("sampling_params"), len(given), batched)
        rids = self._rids(body.get("rid"), len(given), batched)
        adapters = lora_path_names(body.get("lora_path"), len(given), batched)
        named = [r for r in rids if r is not None]
        repeated = sorted({rid for rid in named if named.count(rid) > 1})
        if repeated:  # as SGLang checks a request's ids, before anything else of it
            raise RequestError(f"Duplicate request IDs detected within the request: {repeated}")
        loop = asyncio.get_running_loop()
        prompts = given if not are_texts else await loop.run_in_executor(
            self._tokenizing, lambda: [self.engine.tokenize(text, p.max_new_tokens) for text, p in zip(given, params)])
        gens, futures = [], []
        for ids, rid, prompt_params, adapter in zip(prompts, rids, params, adapters):
            fut = loop.create_future()
            gen = GenRequest(input_ids=ids, params=prompt_params, return_logprob=return_logprob,
                             logprob_start_len=logprob_start_len, lora_name=adapter,
                             on_finish=lambda r, f=fut: loop.call_soon_threadsafe(_resolve, f, r))
            if rid is not None:
                gen.rid = rid
            self.engine.validate(gen)
            gens.append(gen)
            futures.append(fut)
        named = self._register_rids(named)
        try:
            for gen in gens:
                self.engine.submit(gen)
            try:
                await asyncio.gather(*futures)
            except asyncio.CancelledError:  # the client went away: free the batch slots
                for gen in gens:
                    self.engine.abort(rid=gen.rid)
                raise
        finally:
            self._in_flight -= named
        failed = next((g for g in gens if g.error is not None), None)
        if failed is not None:  # 500 where the server failed it: clients retry and then report, never resend as paused
            return error_response(failed.error, failed.error_status)
        replies = [self._reply(g, with_text) for g in gens]
        return web.json_response(replies if batched else replies[0])

    def _register_rids(self, rids: list[str]) -> set[str]:
        """Take the request ids a client gave for the requests about to run; one still running is refused with SGLang
        0.5.10's 400, so that a client which re-sends an id is caught here too."""
        conflicts = set(rids) & self._in_flight
        if conflicts:
            raise RequestError(f"Duplicate request IDs detected: {sorted(conflicts)}")
        self._in_flight |= set(rids)
        return set(rids)

    @staticmethod
    def _sampling_params(raw: Any, n_prompts: int, batched: bool) -> list[SamplingParams]:
        """One SamplingParams per prompt: a batch may give one dict for all or a list with one per prompt."""
        if not isinstance(raw, list):
            return [SamplingParams.from_json(raw)] * n_prompts
        if not batched or len(raw) != n_prompts:
            raise RequestError(f"sampling_params as a list needs one entry per prompt of a batch; got {len(raw)} "
                               f"for {n_prompts} prompt(s){'' if batched else ' (not a batch)'}")
        return [SamplingParams.from_json(p) for p in raw]

    @staticmethod
    def _rids(raw: Any, n_prompts: int, batched: bool) -> list[Optional[str]]:
        if not batched:
            return [None if raw is None else check_str("rid", raw)]
        if not isinstance(raw, list):  # one rid cannot name several requests
            return [None] * n_prompts
        if len(raw) != n_prompts:
            raise RequestError("rid must have one entry per prompt in a batch")
        return [None if rid is None else check_str("rid", rid) for rid in raw]

    @staticmethod
    def _prompts(body: dict) -> tuple[list, bool, bool]:
        """(the prompts as given: texts or token id lists, whether the request is a batch, whether they are texts)."""
        has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
        if has_ids == has_text:
            raise RequestError("exactly one of input_ids or text must be given")
        if has_text:
            text = body["text"]
            batched = isinstance(text, list)
            texts = text if batched else [text]
            if not texts or not all(type(t) is str for t in texts):
                raise RequestError("text must be a string or a non-empty list of strings")
            return texts, batched, True
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids:
            raise RequestError("input_ids must be a non-empty list of token ids (or a list of such lists)")
        batched = isinstance(ids[0], list)
        if batched and not all(isinstance(p, list) for p in ids):
            raise RequestError("input_ids as a batch must be a list of lists of token ids")
        return (ids if batched else [ids]), batched, False

    def _reply(self, g: GenRequest, with_text: bool) -> dict:
        params = g.params
        text = self.engine.tokenizer.decode(g.output_ids, skip_special_tokens=params.skip_special_tokens)
        matched = g.finish_reason.get("matched")
        if isinstance(matched, str) and matched in text:
            text = text[: text.index(matched)]
        meta = {
            "id": g.rid,
            "finish_reason": g.finish_reason,
            "prompt_tokens": len(g.input_ids),
            "completion_tokens": len(g.output_ids),
            "cached_tokens": g.cached_tokens,
            "weight_version": g.weight_version,
            "e2e_latency": g.finished - g.created,
        }
        if g.return_logprob:
            decode = self.engine.tokenizer.decode

            def entry(lp, tok):
                return [lp, tok, decode([tok]) if with_text else None]

            start = max(g.logprob_start_len, 0)
            meta["input_token_logprobs"] = [entry(lp, t) for lp, t in zip(g.input_logprobs, g.input_ids[start:])]
            meta["output_token_logprobs"] = [entry(lp, t) for lp, t in zip(g.output_logprobs, g.output_ids)]
        return {"text": text, "output_ids": g.output_ids, "meta_info": meta}

    # ----- health and info -------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """As SGLang's: 200 once a generation could run; while paused that waits for /continue_generation, and after
        its timeout the answer is 503 (a client that restarts servers on it must not probe paused ones). Asked
        without the credential (the bare liveness probe), a 503 says why to no one: a load error names paths."""
        answer = await self._health()
        if answer.status != 200 and not authorized(request.headers.get("Authorization"), self.token):
            return error_response("the server is not ready", answer.status)
        return answer

    async def _health(self) -> web.Response:
        if (not_ready := self._require_ready()) is not None:
            return not_ready
        deadline = time.monotonic() + self.health_check_timeout
        while self.engine.paused:
            if time.monotonic() >= deadline:
                return error_response(f"health check timed out after {self.health_check_timeout:g}s: generation "
                                      "is paused", 503)
            await asyncio.sleep(0.05)
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        if (not_ready := self._require_ready()) is not None:
            return not_ready
        if (paused := await self.health(request)).status != 200:
            return paused
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        probe = GenRequest(input_ids=[self.engine.eos_ids[0] if self.engine.eos_ids else 0],
                           params=SamplingParams(max_new_tokens=1, temperature=0.0),
                           on_finish=lambda r: loop.call_soon_threadsafe(_resolve, fut, r))
        self.engine.submit(probe)
        result = await asyncio.wait_for(fut, timeout=60)
        if result.finish_reason["type"] == "abort":
            return error_response("health generation was aborted", 503)
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            "model_path": self.engine.model_path,
            "tokenizer_path": self.engine.model_path,
            "is_generation": True,
            "weight_version": self.engine.weight_version,
            "preferred_sampling_params": None,
        })

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({
            **self.server_args,
            "version": f"areal-pipeline-cpu-{__version__}",
            "weight_version": self.engine.weight_version,
            "context_length": self.engine.context_length,
            # which physical GPU (None on the CPU): NCCL cannot join two processes on one GPU (colocated use)
            "gpu_uuid": gpu_uuid(self.engine.device),
            "internal_states": [{**self.engine.stats, "paused": self.engine.paused,
                                 "running_requests": self.engine.num_running()}],
        })

    # ----- control ---------------------------------------------------------------------------------
    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.engine.num_running():
            return web.Response(status=400, text="Cache not flushed: there are running requests.")
        return web.Response(status=200, text="Cache flushed.")

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await read_json_object(request)
        rid = body.get("rid")
        abort_all = check_bool("abort_all", _given(body, "abort_all", False))
        await asyncio.wrap_future(self.engine.abort(rid=None if rid is None else check_str("rid", rid),
                                                    abort_all=abort_all))
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await read_json_object(request)
        mode = _given(body, "mode", "abort")
        if mode != "abort":
            raise RequestError(f"pause mode {shown(mode)} is not supported by the CPU server; use 'abort'")
        await asyncio.wrap_future(self.engine.pause())
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await asyncio.wrap_future(self.engine.resume())
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})


def _resolve(fut: asyncio.Future, result: GenRequest) -> None:
    if not fut.done():
        fut.set_result(result)


def check_device(device: str, mem_fraction: Optional[float]) -> torch.device:
    """The torch device of `--device`, with a clear error where this machine has no such GPU; on CUDA, caps the
    allocator at `mem_fraction` of the device's memory (None: no cap)."""
    if mem_fraction is not None and not 0 < mem_fraction <= 1:
        raise SystemExit(f"--mem-fraction-static={mem_fraction}: must be in (0, 1]")
    dev = torch.device(device)
    if dev.type != "cuda":
        return dev
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0:
        raise SystemExit(f"--device {device}: no CUDA GPU is visible to this process (CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); serve on --device cpu")
    if dev.index is None:
        dev = torch.device("cuda", 0)
    if dev.index >= visible:
        raise SystemExit(f"--device {device}: only {visible} GPU(s) are visible to this process (CUDA_VISIBLE_DEVICES="
                         f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')})")
    torch.cuda.set_device(dev)
    if mem_fraction is not None:
        torch.cuda.set_per_process_memory_fraction(mem_fraction, dev)
    return dev


def serve(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # before the model loads: a server that would refuse its clients, or take anyone's, never starts
        token, ssl_context = service_token("the inference server"), server_ssl_context()
    except CredentialError as e:
        raise SystemExit(str(e)) from None
    device = check_device(args.device, args.mem_fraction_static)
    if args.enable_lora and args.max_lora_rank < 1:  # as SGLang, which needs the rank to size its adapter pool
        raise SystemExit("--enable-lora needs --max-lora-rank R (the largest adapter rank a load takes)")
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    exit_when_parent_dies()
    # A model that cannot load ends the server (non-zero exit), as SGLang does, so launchers fail fast.
    engine = BatchEngine(args.model, max_batch_size=args.max_batch_size, context_length=args.context_length,
                         seed=args.seed, dtype=args.dtype, device=str(device), trust_remote_code=args.trust_remote_code,
                         weight_version=args.weight_version, deterministic=args.enable_deterministic_inference,
                         on_load_failure=lambda: os.kill(os.getpid(), signal.SIGTERM))
    # Listen at once (health says 503 while the model loads), as SGLang does.
    engine.start()
    server = InferenceServer(engine, server_args=vars(args), max_body_bytes=args.max_body_bytes, token=token)
    logger.info("CPU inference server on %s://%s:%d (model %s)%s", "https" if ssl_context else "http", args.host,
                args.port, args.model, "" if token else ", taking requests without a credential")
    # A stop signal ends the requests in flight within a second: a stopped run does not wait for them (aiohttp's
    # default waits a minute, past the launcher's grace period, for e.g. a weight update that is loading).
    web.run_app(server.app(), host=args.host, port=args.port, print=None, access_log=None,
                handle_signals=True, shutdown_timeout=1.0, ssl_context=ssl_context)
    if engine.load_error is not None:
        sys.exit(f"could not load model {args.model}: {engine.load_error}")


def main(argv: Optional[list[str]] = None) -> None:
    serve(build_arg_parser().parse_args(argv))


if __name__ == "__main__":
    main()
