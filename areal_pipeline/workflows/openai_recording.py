"""The OpenAI client an agent of `openai_agent` gets: every request it sends is answered in this process, generated
through the run's inference client, and recorded token by token (see openai_agent.py for the whole story).

`recording_client(episode)` is an `openai.AsyncOpenAI` whose HTTP transport hands each request to its episode
(`RecordingEpisode`): `/v1/chat/completions` and `/v1/completions` become token ids (continuing an earlier completion's
own ids where the conversation extends it), are generated, answered in OpenAI's format (inference/openai_*.py) and
recorded; `trajectories(returned)` turns the records into trajectories once the agent returns its reward.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import uuid
from typing import Any, Optional

import httpx2  # openai's HTTP client library (openai >= 3): the in-process transport plugs into it
from openai import AsyncOpenAI

from areal_pipeline.data.trajectory import NO_VERSION, Trajectory
from areal_pipeline.inference.client import InferenceServerError
from areal_pipeline.inference.openai_errors import OpenAIError, error_body
from areal_pipeline.inference.openai_replies import (
    Generation,
    chat_completion_reply,
    completion_reply,
    generated_text,
    models_reply,
)
from areal_pipeline.inference.openai_requests import ChatRequest, parse_chat_request, parse_completion_request
from areal_pipeline.inference.openai_tools import chat_prompt_ids, tool_call_text
from areal_pipeline.inference.types import ModelRequest, ModelResponse, SamplingParams
from areal_pipeline.utils import get_logger
from areal_pipeline.workflows.rlvr import sample_seed
from areal_pipeline.workflows.turns import turn_record

logger = get_logger(__name__)

BASE_HOST = "openai-agent.invalid"  # never resolved: the transport answers every request in process
BASE_URL = f"http://{BASE_HOST}/v1"


class _NotOurRequests(logging.Filter):
    """httpx2 logs every request at INFO: the agents' in-process ones are thousands an iteration, and no traffic."""

    def filter(self, record: logging.LogRecord) -> bool:
        return BASE_HOST not in record.getMessage()


logging.getLogger("httpx2").addFilter(_NotOurRequests())



@dataclasses.dataclass
class RecordedCompletion:
    """One choice of one request, as the model saw and generated it."""

    completion_id: str  # the reply's id (shared by its choices)
    response: ModelResponse  # prompt ids, generated ids, logprobs, versions, stop reason
    text: str  # the generated text as the agent got it (before tool calls were parsed out)
    messages: Optional[list[dict[str, Any]]] = None  # chat: the request's messages (openai_requests.parse_messages form)
    reply: Optional[dict[str, Any]] = None  # chat: this choice's assistant message, in the same form
    tools: Optional[list[dict[str, Any]]] = None
    template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    num_tool_calls: int = 0
    parent: Optional["RecordedCompletion"] = None  # the completion whose ids this one's prompt extends

    @property
    def ids(self) -> list[int]:
        return self.response.input_tokens + self.response.output_tokens


def ids_after_reply(tokenizer, messages: list[dict[str, Any]], reply_index: int,
                    tools: Optional[list[dict[str, Any]]] = None,
                    template_kwargs: Optional[dict[str, Any]] = None) -> Optional[list[int]]:
    """The token ids the chat template writes after the EOS that ends the assistant reply `messages[reply_index]`:
    the reply's closing, the later messages and the next assistant header. None when the template renders the
    conversation up to the reply differently once it goes on (not a prefix of the whole), or ends the reply without
    the tokenizer's EOS."""
    so_far = chat_prompt_ids(tokenizer, messages[: reply_index + 1], tools, template_kwargs,
                             add_generation_prompt=False)
    whole = chat_prompt_ids(tokenizer, messages, tools, template_kwargs)
    eos = tokenizer.eos_token_id
    if whole[: len(so_far)] != so_far or eos is None or eos not in so_far:
        return None
    return so_far[len(so_far) - so_far[::-1].index(eos):] + whole[len(so_far):]


def discounted_rewards(completion_ids: list[str], returned: Any, discount: float) -> dict[str, float]:
    """Each completion id's reward (in request order): the agent's number for the last one, or its dict's value for
    each id it names, 0 otherwise; then discounted back, R_i = r_i + discount * R_{i+1}."""
    given: dict[str, float] = dict.fromkeys(completion_ids, 0.0)
    if isinstance(returned, dict):
        unknown = [key for key in returned if key not in given]
        if unknown:
            raise ValueError(f"rewards for completion ids this episode never made: {unknown[:3]} (its ids: "
                             f"{completion_ids[:5]}{'...' if len(completion_ids) > 5 else ''})")
        given.update({key: _reward(value, f"the reward of {key}") for key, value in returned.items()})
    else:
        reward = _reward(returned, "the reward")
        if completion_ids:
            given[completion_ids[-1]] = reward
    out, following = {}, 0.0
    for key in reversed(completion_ids):
        following = given[key] + discount * following
        out[key] = following
    return out


def _reward(value: Any, what: str) -> float:
    if type(value) not in (int, float, bool) or not math.isfinite(value):
        raise TypeError(f"{what} must be a finite number (or the agent returns {{completion_id: reward}}), got "
                        f"{value!r}")
    return float(value)


def _comparable(message: dict[str, Any]) -> dict[str, Any]:
    """A message as far as the model's tokens go: tool-call ids are the client's bookkeeping."""
    if not message.get("tool_calls"):
        return message
    return {**message, "tool_calls": [{k: v for k, v in call.items() if k != "id"} for call in message["tool_calls"]]}


class RecordingEpisode:
    """One agent run of `workflow` (an OpenAIAgentWorkflow): answers its client's requests and records them."""

    def __init__(self, workflow: Any, engine, data: dict[str, Any], sample_idx: int):
        self.workflow, self.engine, self.data, self.sample_idx = workflow, engine, data, sample_idx
        self.tokenizer = workflow.tokenizer
        self.completions: list[RecordedCompletion] = []
        self.completion_ids: list[str] = []  # one per request, in order
        self.samples_drawn = 0  # seeds the next sample (sample_seed's turn)
        self.failure: Optional[BaseException] = None  # a request failed (the servers): the episode is incomplete
        self.rid = uuid.uuid4().hex  # the episode's requests stick to one server (its prefix cache)
        self.rid_in_use = False

    # ----- requests ------------------------------------------------------------------------------
    async def chat(self, body: Any) -> dict[str, Any]:
        request = parse_chat_request(body)
        request = dataclasses.replace(request, sampling=self._with_defaults(body, request.sampling))
        prompt_ids = self._chat_prompt(request)
        responses = await self._generate(prompt_ids, request.sampling, request.n)
        generations = [Generation(r.output_tokens, r.output_logprobs, r.stop_reason) for r in responses]
        reply, messages = chat_completion_reply(request, self.tokenizer, prompt_ids, generations)
        self.completion_ids.append(reply["id"])
        for response, generation, choice, message in zip(responses, generations, reply["choices"], messages):
            text = generated_text(self.tokenizer, generation, request.sampling)
            self._record(RecordedCompletion(reply["id"], response, text, request.messages, message, request.tools,
                                            request.template_kwargs,
                                            len(choice["message"].get("tool_calls") or [])))
        return reply

    async def complete(self, body: Any) -> dict[str, Any]:
        request = parse_completion_request(body)
        request = dataclasses.replace(request, sampling=self._with_defaults(body, request.sampling))
        prompts = [p if isinstance(p, list) else self.tokenizer.encode(p) for p in request.prompts]
        per_prompt = [await self._generate(ids, request.sampling, request.n) for ids in prompts]
        generations = [[Generation(r.output_tokens, r.output_logprobs, r.stop_reason) for r in responses]
                       for responses in per_prompt]
        reply = completion_reply(request, self.tokenizer, [len(p) for p in prompts], generations)
        self.completion_ids.append(reply["id"])
        for response, choice in zip([r for responses in per_prompt for r in responses], reply["choices"]):
            self._record(RecordedCompletion(reply["id"], response, choice["text"]))
        return reply

    def models(self) -> dict[str, Any]:
        return models_reply(self.workflow.model_name)

    def _with_defaults(self, body: dict, sampling: SamplingParams) -> SamplingParams:
        """The request's sampling with `rollout.gconfig`'s values where the agent set none, and always its
        temperature (greedy in evaluation)."""
        g = self.workflow.gconfig

        def given(*names: str) -> bool:
            return any(body.get(name) is not None for name in names)

        return dataclasses.replace(
            sampling,
            max_new_tokens=sampling.max_new_tokens if given("max_tokens", "max_completion_tokens") else g.max_new_tokens,
            # the trainer recomputes logprobs at the config's temperature: an agent's own would make them disagree
            temperature=0.0 if g.greedy else g.temperature,
            top_p=sampling.top_p if given("top_p") else g.top_p,
            top_k=sampling.top_k if given("top_k") else g.top_k,
            stop=sampling.stop if given("stop") else tuple(g.stop),
            stop_token_ids=sampling.stop_token_ids if given("stop_token_ids") else tuple(g.stop_token_ids))

    def _chat_prompt(self, request: ChatRequest) -> list[int]:
        earlier = self._conversation_parent(request)
        if earlier is not None:
            spliced = self._continued(earlier, request)
            if spliced is not None:
                return spliced
            logger.debug("the chat template renders the conversation of completion %s differently once it goes on; "
                         "rendering the new request afresh", earlier.completion_id)
        return chat_prompt_ids(self.tokenizer, request.messages, request.tools, request.template_kwargs)

    def _conversation_parent(self, request: ChatRequest) -> Optional[RecordedCompletion]:
        """The latest of the longest earlier chat completions whose messages and reply the request's messages begin
        with (same tools, same template arguments)."""
        found = None
        messages = [_comparable(m) for m in request.messages]
        for c in self.completions:
            if c.messages is None or c.tools != request.tools or c.template_kwargs != request.template_kwargs:
                continue
            k = len(c.messages)
            if (len(messages) > k and messages[k] == _comparable(c.reply)
                    and messages[:k] == [_comparable(m) for m in c.messages]
                    and (found is None or k >= len(found.messages))):
                found = c
        return found

    def _continued(self, earlier: RecordedCompletion, request: ChatRequest) -> Optional[list[int]]:
        """`earlier`'s ids, its EOS if it had none, and the template's ids for the messages after its reply."""
        after = ids_after_reply(self.tokenizer, request.messages, len(earlier.messages), request.tools,
                                request.template_kwargs)
        if after is None:
            return None
        eos = self.tokenizer.eos_token_id
        return earlier.ids + ([] if earlier.response.output_tokens[-1:] == [eos] else [eos]) + after

    async def _generate(self, prompt_ids: list[int], sampling: SamplingParams, n: int) -> list[ModelResponse]:
        requests = []
        for choice in range(n):
            if sampling.sampling_seed is not None:  # the agent's own seed
                seeded = sampling.for_choice(choice)
            else:
                seeded = dataclasses.replace(sampling, **sample_seed(self.data, self.samples_drawn))
            self.samples_drawn += 1
            rid = self.rid if choice == 0 and not self.rid_in_use else uuid.uuid4().hex
            requests.append(ModelRequest(rid=rid, input_ids=list(prompt_ids), sampling=seeded))
        sticky = requests[0].rid == self.rid
        self.rid_in_use |= sticky
        try:
            return await self.engine.agenerate_group(requests)
        except InferenceServerError as e:
            if e.status is not None and 400 <= e.status < 500 and e.status not in (408, 429):
                code = "context_length_exceeded" if "context length" in str(e) else None
                raise OpenAIError(f"the inference server refused the request: {e}", code=code) from None
            raise
        finally:
            if sticky:
                self.rid_in_use = False

    def _record(self, completion: RecordedCompletion) -> None:
        prompt = completion.response.input_tokens
        for c in self.completions:  # the longest earlier sequence this prompt goes on from
            ids = c.ids
            if len(ids) <= len(prompt) and prompt[: len(ids)] == ids and (
                    completion.parent is None or len(ids) >= len(completion.parent.ids)):
                completion.parent = c
        self.completions.append(completion)

    # ----- trajectories --------------------------------------------------------------------------
    def trajectories(self, returned: Any) -> list[Trajectory]:
        rewards = discounted_rewards(self.completion_ids, returned, self.workflow.turn_discount)
        if self.workflow.export_style == "individual":
            chains = [[c] for c in self.completions]
        else:
            continued = {id(c.parent) for c in self.completions if c.parent is not None}
            chains = [self._chain(c) for c in self.completions if id(c) not in continued]
        out = [self._trajectory(chain, rewards) for chain in chains]
        if out:  # per-episode facts on one trajectory, so that agent/<key> averages over episodes
            out[-1].metadata.update({
                "returned_reward": sum(returned.values()) if isinstance(returned, dict) else float(returned),
                "completions": len(self.completions),
                "tool_calls": sum(c.num_tool_calls for c in self.completions)})
        return out

    def _chain(self, last: RecordedCompletion) -> list[RecordedCompletion]:
        chain = [last]
        while self.workflow.export_style == "concat" and chain[-1].parent is not None:
            chain.append(chain[-1].parent)
        return chain[::-1]

    def _trajectory(self, chain: list[RecordedCompletion], rewards: dict[str, float]) -> Trajectory:
        last = chain[-1]
        ids = last.ids
        loss_mask, logprobs, versions = [0] * len(ids), [0.0] * len(ids), [NO_VERSION] * len(ids)
        for c in chain:
            start, response = len(c.response.input_tokens), c.response
            end = start + response.output_len
            loss_mask[start:end] = [1] * response.output_len
            logprobs[start:end] = response.output_logprobs
            versions[start:end] = response.output_versions
        prompt_len = len(chain[0].response.input_tokens)
        return Trajectory(
            prompt_id=self.data["prompt_id"], group_id=self.data["prompt_id"], sample_idx=self.sample_idx,
            input_ids=ids, loss_mask=loss_mask, logprobs=logprobs, versions=versions,
            reward=rewards[last.completion_id], num_turns=len(chain), stop_reason=last.response.stop_reason,
            messages=self._shown_messages(last), text=self.tokenizer.decode(ids[prompt_len:], skip_special_tokens=True),
            metadata={"answer": self.data.get("answer"), "server": last.response.server,
                      "completion_ids": [c.completion_id for c in chain],
                      "turns": [turn_record(c.response, c.text, reward=rewards[c.completion_id]) for c in chain]})

    def _shown_messages(self, last: RecordedCompletion) -> list[dict[str, str]]:
        """The conversation for humans (the shards' `messages`): tool calls written out, tool results as `tool`."""
        if last.messages is None:
            return [{"role": "user", "content": self.tokenizer.decode(last.response.input_tokens)},
                    {"role": "assistant", "content": last.text}]
        shown = []
        for m in last.messages:
            content = m["content"]
            if m.get("tool_calls"):
                calls = [tool_call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
                content = "\n".join(([content] if content else []) + calls)
            shown.append({"role": m["role"], "content": content})
        return shown + [{"role": "assistant", "content": last.text}]


def answer_limit(engine: Any) -> float:
    """The longest one of the agent's requests can take: every try of the engine's (`request_timeout`, with its
    retries' backoff), plus a wait for a resume (`pause_timeout`). httpx's own timeouts are a network
    transport's; the in-process transport enforces this one itself."""
    timeout = getattr(engine, "request_timeout", 3600.0)
    retries = getattr(engine, "request_retries", 3)
    backoff = getattr(engine, "retry_delay", 1.0) * (2 ** retries)
    return timeout * (retries + 1) + backoff + getattr(engine, "pause_timeout", 600.0)


class InProcessTransport(httpx2.AsyncBaseTransport):
    """The agent's client's HTTP: each request answered by its episode, in this process."""

    def __init__(self, episode: RecordingEpisode):
        self.episode = episode

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        path, method = request.url.path.rstrip("/"), request.method
        routes = {("POST", "/v1/chat/completions"): self.episode.chat,
                  ("POST", "/v1/completions"): self.episode.complete}
        try:
            if (method, path) == ("GET", "/v1/models"):
                return httpx2.Response(200, json=self.episode.models())
            route = routes.get((method, path))
            if route is None:
                return httpx2.Response(404, json=error_body(
                    f"{method} {path} is not served here; the agent's client serves POST /v1/chat/completions, "
                    "POST /v1/completions and GET /v1/models", "not_found_error"))
            try:
                body = json.loads(await request.aread())
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise OpenAIError(f"the request body is not valid JSON: {e}") from None
            limit = answer_limit(self.episode.engine)
            try:
                return httpx2.Response(200, json=await asyncio.wait_for(route(body), limit))
            except asyncio.TimeoutError:
                raise TimeoutError(f"{method} {path}: no answer from the inference engine within {limit:g} s "
                                   "(its request timeout, retries and pause timeout)") from None
        except OpenAIError as e:
            return httpx2.Response(e.status, json=e.body())
        except Exception as e:
            # The rollout fails with this whatever the agent does; the agent sees what a lost server looks like
            # through the SDK (APIConnectionError).
            self.episode.failure = self.episode.failure or e
            raise httpx2.TransportError(f"{type(e).__name__}: {e}") from e



def recording_client(episode: "RecordingEpisode") -> AsyncOpenAI:
    """The agent's client: its requests are answered by `episode`, in process."""
    # No retries in the client: the inference client retries the servers itself, and a refused request stays one.
    # No timeout of httpx's: the transport bounds each request (`answer_limit`).
    return AsyncOpenAI(base_url=BASE_URL, api_key="areal-pipeline", max_retries=0,
                       http_client=httpx2.AsyncClient(transport=InProcessTransport(episode), base_url=BASE_URL,
                                                      timeout=None))
