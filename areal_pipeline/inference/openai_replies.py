"""OpenAI's replies (`chat.completion`, `text_completion`, the model list) from generated tokens."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from areal_pipeline.inference.openai_requests import ChatRequest, CompletionRequest, parse_message
from areal_pipeline.inference.openai_tools import parse_tool_calls
from areal_pipeline.inference.types import SamplingParams


@dataclass
class Generation:
    """One sample: its tokens and their logprobs, and why it ended ("stop": EOS, a stop token or string; "length");
    where known, the weight version that produced each token and the one it ended under (-1: not a number)."""

    output_ids: list[int]
    logprobs: list[float]
    finish: str
    versions: list[int] = field(default_factory=list)
    version: int = -1


def generated_text(tokenizer, generation: Generation, sampling: SamplingParams) -> str:
    """The reply's text: special tokens skipped (unless the request says otherwise), a matched stop string cut off
    with whatever came after it in the same token."""
    text = tokenizer.decode(generation.output_ids, skip_special_tokens=sampling.skip_special_tokens)
    if generation.finish == "stop" and sampling.stop:
        found = [text.find(s) for s in sampling.stop if s in text]
        if found:
            text = text[: min(found)]
    return text


def _token_logprobs(tokenizer, generation: Generation) -> list[tuple[str, float]]:
    return [(tokenizer.decode([t]), lp) for t, lp in zip(generation.output_ids, generation.logprobs)]


def chat_completion_reply(request: ChatRequest, tokenizer, prompt_ids: list[int], generations: list[Generation],
                          completion_id: Optional[str] = None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(the `chat.completion` object, each choice's assistant message as `parse_messages` would give it back)."""
    choices, messages = [], []
    for index, generation in enumerate(generations):
        text = generated_text(tokenizer, generation, request.sampling)
        content, calls = (parse_tool_calls(text, request.tool_names, not request.parallel_tool_calls)
                          if request.tools else (text, []))
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        logprobs = None
        if request.logprobs:
            logprobs = {"content": [{"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []}
                                    for token, lp in _token_logprobs(tokenizer, generation)], "refusal": None}
        choices.append({"index": index, "message": message, "logprobs": logprobs,
                        "finish_reason": "tool_calls" if calls else generation.finish})
        messages.append(parse_message(message, f"choices[{index}].message"))
    reply = {"id": completion_id or f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
             "created": int(time.time()), "model": request.model, "choices": choices,
             "usage": _usage(len(prompt_ids), generations), "system_fingerprint": None}
    return reply, messages


def completion_reply(request: CompletionRequest, tokenizer, prompt_lengths: list[int],
                     generations: list[list[Generation]], completion_id: Optional[str] = None) -> dict[str, Any]:
    """The `text_completion` object: `generations[i]` are prompt i's n samples (choice index i * n + j)."""
    choices = []
    for i, samples in enumerate(generations):
        for j, generation in enumerate(samples):
            logprobs = None
            if request.logprobs:
                pairs = _token_logprobs(tokenizer, generation)
                offsets, at = [], 0
                for token, _ in pairs:
                    offsets.append(at)
                    at += len(token)
                logprobs = {"tokens": [t for t, _ in pairs], "token_logprobs": [lp for _, lp in pairs],
                            "top_logprobs": None, "text_offset": offsets}
            choices.append({"index": i * request.n + j, "text": generated_text(tokenizer, generation, request.sampling),
                            "logprobs": logprobs, "finish_reason": generation.finish})
    usage = _usage(0, [g for samples in generations for g in samples])
    usage["prompt_tokens"] = sum(prompt_lengths)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    return {"id": completion_id or f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": request.model, "choices": choices, "usage": usage}


def _usage(prompt_tokens: int, generations: list[Generation]) -> dict[str, int]:
    completion_tokens = sum(len(g.output_ids) for g in generations)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def models_reply(model_id: str, context_length: Optional[int] = None,
                 adapters: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """The model, and each LoRA adapter loaded (`adapters`: name -> path) as vLLM and SGLang list them."""
    entry = {"id": model_id, "object": "model", "created": 0, "owned_by": "areal-pipeline", "root": model_id}
    if context_length:
        entry["max_model_len"] = context_length
    loaded = [{**entry, "id": name, "root": path, "parent": model_id} for name, path in (adapters or {}).items()]
    return {"object": "list", "data": [entry, *loaded]}
