"""The OpenAI API on the project's inference: `/v1/chat/completions`, `/v1/completions` and `/v1/models` in OpenAI's
wire format, as SGLang serves them. The CPU server's routes (`OpenAIRoutes`, here) and the openai_agent workflow's
in-process client (`workflows/openai_recording.py`) share the pieces:

    request = parse_chat_request(body)         # openai_requests.py; OpenAIError on bad input (openai_errors.py)
    prompt_ids = chat_prompt_ids(tokenizer, request.messages, request.tools, request.template_kwargs)  # openai_tools
    generations = ...                          # request.n samples of request.sampling (one Generation each)
    reply, messages = chat_completion_reply(request, tokenizer, prompt_ids, generations)  # openai_replies.py

What is sampled and what is refused: openai_requests.py; chat templates and tool calls: openai_tools.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import uuid
from typing import Any, Optional

from aiohttp import web

from areal_pipeline.http_json import RequestRejected, read_json_object
from areal_pipeline.inference.engine import PAUSED_FOR_WEIGHT_UPDATE
from areal_pipeline.inference.kv_batch import GenRequest
from areal_pipeline.inference.openai_errors import OpenAIError, as_openai_error, error_body
from areal_pipeline.inference.openai_replies import Generation, chat_completion_reply, completion_reply, models_reply
from areal_pipeline.inference.openai_requests import parse_chat_request, parse_completion_request
from areal_pipeline.inference.openai_tools import chat_prompt_ids
from areal_pipeline.inference.types import SamplingParams


def openai_errors(handler):
    """Answer a /v1 handler's refused request in OpenAI's error shape rather than SGLang's."""
    @functools.wraps(handler)
    async def wrapped(self, request: web.Request) -> web.Response:
        try:
            return await handler(self, request)
        except RequestRejected as e:
            error = as_openai_error(e)
            return web.json_response(error.body(), status=error.status)
    return wrapped


class OpenAIRoutes:
    """The CPU inference server's `/v1` routes, on its engine (`server.InferenceServer`: `engine`, `_tokenizing`,
    `_require_ready`, and `recording`, which records each chat completion before it is answered: recording_routes.py).
    A generation interrupted by a weight update (`/pause_generation`) goes on after `/continue_generation` under the
    new weights, as the project's client resumes SGLang's: the reply is whole, each token keeping its version."""

    def __init__(self, server):
        self.server = server

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_post("/v1/chat/completions", self.chat_completions)
        router.add_post("/v1/completions", self.completions)
        router.add_get("/v1/models", self.models)

    def _not_ready(self) -> Optional[web.Response]:
        refused = self.server._require_ready()
        if refused is None:
            return None
        message = json.loads(refused.text)["error"]["message"]
        return web.json_response(error_body(message, "service_unavailable"), status=refused.status)

    @openai_errors
    async def chat_completions(self, request: web.Request) -> web.Response:
        if (refused := self._not_ready()) is not None:
            return refused
        body = await read_json_object(request)
        chat = parse_chat_request(body)
        engine = self.server.engine
        prompt_ids = await asyncio.get_running_loop().run_in_executor(
            self.server._tokenizing, lambda: chat_prompt_ids(engine.tokenizer, chat.messages, chat.tools,
                                                             chat.template_kwargs))
        generations = await self._generate(prompt_ids, chat.sampling, chat.n, self._adapter(chat.model))
        reply, _ = chat_completion_reply(chat, engine.tokenizer, prompt_ids, generations,
                                         completion_id=f"chatcmpl-{uuid.uuid4().hex}")
        recording = getattr(self.server, "recording", None)
        if recording is not None and recording.enabled:  # durable before the client hears of it
            await recording.record_chat(request, body, chat, prompt_ids, generations, reply)
        return web.json_response(reply)

    @openai_errors
    async def completions(self, request: web.Request) -> web.Response:
        if (refused := self._not_ready()) is not None:
            return refused
        completion = parse_completion_request(await read_json_object(request))
        engine = self.server.engine
        budget = completion.sampling.max_new_tokens
        prompts = await asyncio.get_running_loop().run_in_executor(
            self.server._tokenizing, lambda: [p if isinstance(p, list) else engine.tokenize(p, budget)
                                              for p in completion.prompts])
        adapter = self._adapter(completion.model)
        generations = await asyncio.gather(*(self._generate(ids, completion.sampling, completion.n, adapter)
                                             for ids in prompts))
        return web.json_response(completion_reply(completion, engine.tokenizer, [len(p) for p in prompts],
                                                  list(generations)))

    async def models(self, request: web.Request) -> web.Response:
        engine = self.server.engine
        return web.json_response(models_reply(engine.model_path, engine.context_length if engine.ready.is_set()
                                              else None, adapters=engine.adapter.loaded()))

    def _adapter(self, model: str) -> Optional[str]:
        """The LoRA adapter `model` names (as SGLang's and vLLM's OpenAI routes take it), or None: the base."""
        return model if model == self.server.engine.adapter.name else None

    async def _generate(self, prompt_ids: list[int], sampling: SamplingParams, n: int,
                        adapter: Optional[str] = None) -> list[Generation]:
        """n samples of one prompt, submitted together (the engine prefills the shared prompt once); a sample that a
        pause interrupted is sent again with its tokens so far and the rest of its budget."""
        engine = self.server.engine
        # without max_tokens, the room left: prompt + budget must stay below the context length (as SGLang checks)
        budget = sampling.max_new_tokens if sampling.max_new_tokens is not None else engine.context_length - 1 - len(prompt_ids)
        if budget < 1:
            raise OpenAIError(f"the prompt has {len(prompt_ids)} tokens: no room is left to generate in the model's "
                              f"maximum context length of {engine.context_length} tokens", "messages",
                              "context_length_exceeded")
        samples = [Generation([], [], "abort") for _ in range(n)]
        loop = asyncio.get_running_loop()
        while pending := [(i, s) for i, s in enumerate(samples)
                          if s.finish == "abort" and len(s.output_ids) < budget]:
            requests, futures = [], []
            for i, sample in pending:
                params = dataclasses.replace(sampling.for_choice(i), max_new_tokens=budget - len(sample.output_ids))
                future = loop.create_future()
                gen = GenRequest(input_ids=prompt_ids + sample.output_ids, params=params, return_logprob=True,
                                 lora_name=adapter,
                                 on_finish=lambda r, f=future: loop.call_soon_threadsafe(_resolve, f, r))
                engine.validate(gen)
                requests.append(gen)
                futures.append(future)
            for gen in requests:
                engine.submit(gen)
            try:
                await asyncio.gather(*futures)
            except asyncio.CancelledError:  # the client went away: free the batch slots
                for gen in requests:
                    engine.abort(rid=gen.rid)
                raise
            failed = next((gen for gen in requests if gen.error is not None), None)
            if failed is not None:
                if failed.error_status == 400:  # its adapter was swapped out while it queued
                    raise OpenAIError(failed.error, code="model_not_found", status=400)
                raise OpenAIError(failed.error, code="internal_error", status=500, error_type="server_error")
            for (_, sample), gen in zip(pending, requests):
                sample.output_ids += gen.output_ids
                sample.logprobs += gen.output_logprobs
                sample.version = _version_number(gen.weight_version)  # the version this part of it ended under
                sample.versions += [_version_number(v) for v in gen.output_versions]
                reason = gen.finish_reason
                if reason["type"] != "abort":
                    sample.finish = reason["type"]
                elif reason.get("message") != PAUSED_FOR_WEIGHT_UPDATE:
                    raise OpenAIError(f"the generation was aborted: {reason.get('message')}", code="aborted",
                                      status=503, error_type="service_unavailable")
        for sample in samples:
            if sample.finish == "abort":  # interrupted just as its budget ran out
                sample.finish = "length"
        return samples


def _version_number(label: str) -> int:
    """The engine's weight version label as a number (-1 where it is not one)."""
    try:
        return int(label)
    except (TypeError, ValueError):
        return -1


def _resolve(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)
