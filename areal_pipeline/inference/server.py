"""The CPU inference server: SGLang's native HTTP API (the subset in sglang-protocol.md) on transformers.

    python -m areal_pipeline.inference.server --model PATH --host 127.0.0.1 --port 30000

A client written for a real SGLang server works against it unchanged. Generation runs in
`BatchEngine`, which decodes all concurrent requests together.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from typing import Any, Optional

import torch
from aiohttp import web

from areal_pipeline import __version__
from areal_pipeline.inference.engine import BatchEngine, GenRequest, RequestError, SamplingParams
from areal_pipeline.utils import exit_when_parent_dies, get_logger

logger = get_logger(__name__)

GENERATE_KEYS = {"input_ids", "text", "sampling_params", "return_logprob", "logprob_start_len",
                 "top_logprobs_num", "return_text_in_logprobs", "rid", "stream"}


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


async def _json_body(request: web.Request) -> dict:
    if not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except json.JSONDecodeError as e:
        raise RequestError(f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


class InferenceServer:
    def __init__(self, engine: BatchEngine, server_args: dict[str, Any]):
        self.engine = engine
        self.server_args = server_args
        self.weight_groups: dict[str, Any] = {}  # group_name -> (process group, store)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30, middlewares=[self._errors])
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, self.model_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_route("*", "/get_weights_by_name", self.get_weights_by_name)
        r.add_post("/init_weights_update_group", self.init_weights_update_group)
        r.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        app.on_shutdown.append(self._shutdown)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except RequestError as e:
            return _error(str(e))
        except web.HTTPException:
            raise
        except Exception as e:
            logger.exception("error serving %s", request.path)
            return _error(f"internal error: {e}", status=500)

    async def _shutdown(self, app) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.engine.shutdown)

    def _require_ready(self) -> Optional[web.Response]:
        if self.engine.load_error is not None:
            return _error(f"model failed to load: {self.engine.load_error}", status=503)
        if not self.engine.ready.is_set():
            return _error("the server is starting", status=503)
        return None

    # ----- generation ------------------------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.Response:
        if (not_ready := self._require_ready()) is not None:
            return not_ready
        body = await _json_body(request)
        unknown = set(body) - GENERATE_KEYS
        if unknown:
            raise RequestError(f"unknown field(s) {sorted(unknown)}; valid: {sorted(GENERATE_KEYS)}")
        if body.get("stream"):
            raise RequestError("stream=true is not supported by the CPU server; send stream=false")
        if body.get("top_logprobs_num", 0):
            raise RequestError("top_logprobs_num > 0 is not supported by the CPU server")
        prompts, batched = self._prompts(body)
        params = self._sampling_params(body.get("sampling_params"), len(prompts), batched)
        rids = body.get("rid")
        if batched:
            rids = rids if isinstance(rids, list) else [None] * len(prompts)
            if len(rids) != len(prompts):
                raise RequestError("rid must have one entry per prompt in a batch")
        else:
            rids = [rids]
        loop = asyncio.get_running_loop()
        gens, futures = [], []
        for ids, rid, prompt_params in zip(prompts, rids, params):
            fut = loop.create_future()
            gen = GenRequest(input_ids=ids, params=prompt_params, return_logprob=bool(body.get("return_logprob")),
                             logprob_start_len=int(body.get("logprob_start_len", -1)),
                             on_finish=lambda r, f=fut: loop.call_soon_threadsafe(_resolve, f, r))
            if rid is not None:
                gen.rid = str(rid)
            self.engine.validate(gen)
            gens.append(gen)
            futures.append(fut)
        for gen in gens:
            self.engine.submit(gen)
        try:
            await asyncio.gather(*futures)
        except asyncio.CancelledError:  # the client went away: free the batch slots
            for gen in gens:
                self.engine.abort(rid=gen.rid)
            raise
        replies = [self._reply(g, body) for g in gens]
        return web.json_response(replies if batched else replies[0])

    @staticmethod
    def _sampling_params(raw: Any, n_prompts: int, batched: bool) -> list[SamplingParams]:
        """One SamplingParams per prompt: a batch may give one dict for all or a list with one per prompt."""
        if not isinstance(raw, list):
            return [SamplingParams.from_json(raw)] * n_prompts
        if not batched or len(raw) != n_prompts:
            raise RequestError(f"sampling_params as a list needs one entry per prompt of a batch; got {len(raw)} "
                               f"for {n_prompts} prompt(s){'' if batched else ' (not a batch)'}")
        return [SamplingParams.from_json(p) for p in raw]

    def _prompts(self, body: dict) -> tuple[list[list[int]], bool]:
        has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
        if has_ids == has_text:
            raise RequestError("exactly one of input_ids or text must be given")
        if has_text:
            text = body["text"]
            batched = isinstance(text, list)
            texts = text if batched else [text]
            if not all(isinstance(t, str) for t in texts):
                raise RequestError("text must be a string or a list of strings")
            return [self.engine.tokenizer(t)["input_ids"] for t in texts], batched
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids:
            raise RequestError("input_ids must be a non-empty list of token ids (or a list of such lists)")
        batched = isinstance(ids[0], list)
        return (ids if batched else [ids]), batched

    def _reply(self, g: GenRequest, body: dict) -> dict:
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
        if body.get("return_logprob"):
            with_text = bool(body.get("return_text_in_logprobs"))
            decode = self.engine.tokenizer.decode

            def entry(lp, tok):
                return [lp, tok, decode([tok]) if with_text else None]

            start = max(int(body.get("logprob_start_len", -1)), 0)
            meta["input_token_logprobs"] = [entry(lp, t) for lp, t in zip(g.input_logprobs, g.input_ids[start:])]
            meta["output_token_logprobs"] = [entry(lp, t) for lp, t in zip(g.output_logprobs, g.output_ids)]
        return {"text": text, "output_ids": g.output_ids, "meta_info": meta}

    # ----- health and info -------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        if (not_ready := self._require_ready()) is not None:
            return not_ready
        return web.Response(status=200)

    async def health_generate(self, request: web.Request) -> web.Response:
        if (not_ready := self._require_ready()) is not None:
            return not_ready
        if self.engine.paused:  # a generation would wait for /continue_generation
            return web.Response(status=200)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        probe = GenRequest(input_ids=[self.engine.eos_ids[0] if self.engine.eos_ids else 0],
                           params=SamplingParams(max_new_tokens=1, temperature=0.0),
                           on_finish=lambda r: loop.call_soon_threadsafe(_resolve, fut, r))
        self.engine.submit(probe)
        result = await asyncio.wait_for(fut, timeout=60)
        if result.finish_reason["type"] == "abort":
            return _error("health generation was aborted", status=503)
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
            "internal_states": [{**self.engine.stats, "paused": self.engine.paused,
                                 "running_requests": self.engine.num_running()}],
        })

    # ----- control ---------------------------------------------------------------------------------
    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.engine.num_running():
            return web.Response(status=400, text="Cache not flushed: there are running requests.")
        return web.Response(status=200, text="Cache flushed.")

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        await asyncio.wrap_future(self.engine.abort(rid=body.get("rid"), abort_all=bool(body.get("abort_all"))))
        return web.Response(status=200)

    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        mode = body.get("mode", "abort")
        if mode != "abort":
            raise RequestError(f"pause mode '{mode}' is not supported by the CPU server; use 'abort'")
        await asyncio.wrap_future(self.engine.pause())
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        await asyncio.wrap_future(self.engine.resume())
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        if (not_ready := self._require_ready()) is not None:
            return not_ready
        body = await _json_body(request)
        path = body.get("model_path")
        if not path:
            raise RequestError("model_path is required")
        if body.get("load_format") not in (None, "safetensors", "auto"):
            raise RequestError("the CPU server loads safetensors weights only")
        version = body.get("weight_version")
        if body.get("abort_all_requests"):
            await asyncio.wrap_future(self.engine.abort(abort_all=True))
        num_paused = self.engine.num_running()
        started = time.perf_counter()
        try:
            count = await asyncio.wrap_future(
                self.engine.update_weights_from_disk(path, None if version is None else str(version)))
        except RequestError as e:
            return web.json_response({"success": False, "message": str(e), "num_paused_requests": 0}, status=400)
        return web.json_response({
            "success": True,
            "message": f"Succeeded to update model weights ({count} tensors in "
                       f"{time.perf_counter() - started:.3f}s); weight_version={self.engine.weight_version}",
            "num_paused_requests": num_paused,
            "weight_version": self.engine.weight_version,
        })

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        from areal_pipeline.training.weight_sync import create_weight_update_group

        body = await _json_body(request)
        try:
            args = (body.get("backend", "gloo"), body["master_address"], int(body["master_port"]),
                    int(body["rank_offset"]), int(body["world_size"]), body.get("group_name", "weight_update_group"))
        except (KeyError, TypeError, ValueError) as e:
            raise RequestError(f"init_weights_update_group needs master_address, master_port, rank_offset and "
                               f"world_size: {e!r}") from e
        if args[0] != "gloo":
            raise RequestError(f"the CPU server joins weight-update groups over gloo, not {args[0]!r}")
        try:  # joining blocks until every member is there: keep it off the event loop and the engine
            group = await asyncio.get_running_loop().run_in_executor(None, lambda: create_weight_update_group(*args))
        except Exception as e:
            return web.json_response({"success": False, "message": f"could not join the group: {e}"}, status=400)
        self.weight_groups[args[-1]] = group
        return web.json_response({"success": True, "message": f"joined {args[-1]} as rank {args[3]}"})

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        name = body.get("group_name", "weight_update_group")
        if name not in self.weight_groups:
            return web.json_response({"success": False, "message": f"no weight-update group {name!r}; "
                                      "call /init_weights_update_group first"}, status=400)
        names, dtypes, shapes = body.get("names") or [], body.get("dtypes") or [], body.get("shapes") or []
        if not (len(names) == len(dtypes) == len(shapes)):
            raise RequestError("names, dtypes and shapes must have the same length")
        if body.get("abort_all_requests"):
            await asyncio.wrap_future(self.engine.abort(abort_all=True))
        version = body.get("weight_version")
        try:
            count = await asyncio.wrap_future(self.engine.update_weights_from_group(
                self.weight_groups[name][0], names, dtypes, shapes, None if version is None else str(version)))
        except Exception as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        return web.json_response({"success": True, "message": f"updated {count} tensors; "
                                  f"weight_version={self.engine.weight_version}"})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        removed = self.weight_groups.pop(body.get("group_name", "weight_update_group"), None)
        return web.json_response({"success": removed is not None,
                                  "message": "destroyed" if removed else "no such group"})

    async def get_weights_by_name(self, request: web.Request) -> web.Response:
        body = await _json_body(request) if request.method == "POST" else dict(request.query)
        name = body.get("name")
        truncate = int(body.get("truncate_size", 100))

        def read():
            params = dict(self.engine.model.named_parameters())
            if name not in params:
                raise RequestError(f"no parameter named {name!r}")
            return params[name].detach().float().flatten()[:truncate].tolist()

        return web.json_response(await asyncio.wrap_future(self.engine.call(read)))


def _resolve(fut: asyncio.Future, result: GenRequest) -> None:
    if not fut.done():
        fut.set_result(result)


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="SGLang-API-compatible CPU inference server")
    p.add_argument("--model", "--model-path", dest="model", required=True, help="HF model directory or hub id")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--max-batch-size", type=int, default=128)
    p.add_argument("--context-length", type=int, default=0, help="0: the model's max_position_embeddings")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=0, help="torch intra-op threads (0: default)")
    p.add_argument("--weight-version", default="0")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--log-level", default="info")
    return p


def serve(args: argparse.Namespace) -> None:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    exit_when_parent_dies()
    # A model that cannot load ends the server (non-zero exit), as SGLang does, so launchers fail fast.
    engine = BatchEngine(args.model, max_batch_size=args.max_batch_size, context_length=args.context_length,
                         seed=args.seed, dtype=args.dtype, trust_remote_code=args.trust_remote_code,
                         weight_version=args.weight_version,
                         on_load_failure=lambda: os.kill(os.getpid(), signal.SIGTERM))
    # Listen at once (health says 503 while the model loads), as SGLang does.
    engine.start()
    server = InferenceServer(engine, server_args=vars(args))
    logger.info("CPU inference server on http://%s:%d (model %s)", args.host, args.port, args.model)
    web.run_app(server.app(), host=args.host, port=args.port, print=None, access_log=None,
                handle_signals=True)
    if engine.load_error is not None:
        sys.exit(f"could not load model {args.model}: {engine.load_error}")


def main(argv: Optional[list[str]] = None) -> None:
    serve(build_arg_parser().parse_args(argv))


if __name__ == "__main__":
    main()
