"""Agents written against the OpenAI API train as they are (AReaL 1.0's OpenAI-compatible agents).

The user writes, in a module of their own,

    async def agent(client: AsyncOpenAI, data: dict) -> float | dict[str, float]:
        completion = await client.chat.completions.create(model="default", messages=data["messages"], tools=TOOLS)
        ...                                   # call tools, append messages, ask again
        return reward                         # the last completion's reward, or {completion.id: reward, ...}

and names it in the config: `rollout.workflow=openai_agent rollout.agent.entry=my_module:agent` (a module importable
from the working directory, or `path/to/file.py:agent`). `data` is the data set record (`messages`, `answer`,
`question`, `prompt_id`, ...). Each episode hands the agent a real `openai.AsyncOpenAI` whose HTTP client answers in
process (an httpx transport: no socket, no proxy process): each `/v1/chat/completions` or `/v1/completions` request
becomes token ids, is generated through the run's inference client (`RemoteSGLangEngine.agenerate_group`: a weight
update interrupts it, it resumes under the new weights, and every token keeps the policy version that produced it)
and is answered in OpenAI's format by `inference/openai_api.py` (chat template, sampling fields, Qwen `<tool_call>`
parser, errors); `/v1/models` names the served model. Every choice of every request is recorded with its exact
prompt ids, generated ids, logprobs and versions.

Token-exactness: when a chat request's messages extend an earlier completion's (its messages, then its reply as the
client returned it, SDK null fields and tool-call ids aside), the prompt is that completion's own prompt and generated
ids, its EOS if it stopped without one, then the template's ids for what follows (the rendered conversation's ids past
the rendered earlier part, which must be a prefix of them). The model is conditioned on the tokens it generated,
never on a re-tokenisation of their decoded text; otherwise the conversation is rendered afresh. A text completion's
prompt is taken as given (send token ids for exactness).

Trajectories, `agent.export_style`:
- concat (default): a completion whose prompt ids extend an earlier completion's ids (prompt + generated) continues
  it; each chain's last completion is one trajectory: its ids, loss_mask 1 on the generated tokens of every
  completion of the chain (their logprobs and versions), 0 on the prompt and on what the environment added (tool
  results, template tokens). A linear conversation is one trajectory; an agent that rewrites its history starts a
  new one at each rewrite.
- individual: one trajectory per completion: its prompt, then its generated tokens.

Rewards, as AReaL's `apply_reward_discount`: a number returned is the last completion's reward, a dict gives rewards
by completion id (`completion.id`; the choices of one request share it) and the others get 0; then, over the requests
in order, `R_i = r_i + agent.turn_discount * R_{i+1}`. A trajectory takes its last completion's R. The returned number
(a dict's sum) and the counts of completions and tool calls are per-episode facts (`agent/returned_reward`,
`agent/completions`, `agent/tool_calls`), kept on the episode's last trajectory so they average over episodes.

`rollout.gconfig` gives each request's defaults (max_new_tokens, top_p, top_k, stop), which what the agent's request
sets overrides; the temperature is always the config's (`gconfig.temperature`, 0 for a greedy config: evaluation),
since the trainer recomputes logprobs at that temperature. `gconfig.n_samples` agents run per prompt (the GRPO group,
`group_id` = the prompt), and each request is seeded from the rollout's episode seed unless the agent gives `seed`.

Failures: an agent that raises fails the rollout with its error and the prompt it was on, as any workflow's error
does. A failure of the inference servers reaches the rollout as itself (a transient fault, retried by the node),
whatever the agent made of it. A request the server refuses (a conversation outgrowing the context) reaches the agent
as `openai.BadRequestError`, for it to handle.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import json
import logging
import math
import os
import sys
import uuid
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

import httpx2  # openai's HTTP client library (openai >= 3): the in-process transport plugs into it
from openai import AsyncOpenAI

from areal_pipeline.config import GenerationConfig
from areal_pipeline.data.trajectory import NO_VERSION, Trajectory
from areal_pipeline.inference.client import InferenceServerError
from areal_pipeline.inference.openai_api import (
    ChatRequest,
    Generation,
    OpenAIError,
    Sampling,
    chat_completion_reply,
    chat_prompt_ids,
    completion_reply,
    error_body,
    generated_text,
    models_reply,
    parse_chat_request,
    parse_completion_request,
    tool_call_text,
)
from areal_pipeline.inference.types import ModelRequest, ModelResponse
from areal_pipeline.utils import get_logger
from areal_pipeline.workflows.reflection import turn_record
from areal_pipeline.workflows.rlvr import sample_seed

logger = get_logger(__name__)

Agent = Callable[[AsyncOpenAI, dict], Awaitable[Any]]
EXPORT_STYLES = ("concat", "individual")
BASE_HOST = "openai-agent.invalid"  # never resolved: the transport answers every request in process
BASE_URL = f"http://{BASE_HOST}/v1"
ENTRY_FORM = "'module:function' (importable from the working directory) or 'path/to/file.py:function'"


class _NotOurRequests(logging.Filter):
    """httpx2 logs every request at INFO: the agents' in-process ones are thousands an iteration, and no traffic."""

    def filter(self, record: logging.LogRecord) -> bool:
        return BASE_HOST not in record.getMessage()


logging.getLogger("httpx2").addFilter(_NotOurRequests())


class AgentError(RuntimeError):
    """The user's agent raised; its exception is the cause (and decides whether a retry may help)."""


@functools.lru_cache(maxsize=32)
def load_agent(entry: str) -> Agent:
    """The agent function named by `rollout.agent.entry`: 'module:function' or 'path/to/file.py:function'."""
    module_name, _, function = entry.rpartition(":")
    if not module_name or not function:
        raise ValueError(f"rollout.agent.entry={entry!r}: must be {ENTRY_FORM}")
    if module_name.endswith(".py") or "/" in module_name or os.sep in module_name:
        path = Path(module_name).expanduser().resolve()
        if not path.is_file():
            raise FileNotFoundError(f"rollout.agent.entry={entry!r}: no such file {path}")
        spec = importlib.util.spec_from_file_location(f"openai_agent_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        # As `python -m` and uvicorn do: a module beside the config imports however the command was started.
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            raise ModuleNotFoundError(f"rollout.agent.entry={entry!r}: cannot import {module_name!r} ({e}); "
                                      f"give {ENTRY_FORM}") from e
    agent = getattr(module, function, None)
    if agent is None:
        raise AttributeError(f"rollout.agent.entry={entry!r}: {module_name} has no {function!r}")
    if not (inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(getattr(agent, "__call__", None))):
        raise TypeError(f"rollout.agent.entry={entry!r}: {function} must be an async function "
                        "agent(client: AsyncOpenAI, data: dict) -> float | dict[str, float]")
    return agent


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


@dataclasses.dataclass
class RecordedCompletion:
    """One choice of one request, as the model saw and generated it."""

    completion_id: str  # the reply's id (shared by its choices)
    response: ModelResponse  # prompt ids, generated ids, logprobs, versions, stop reason
    text: str  # the generated text as the agent got it (before tool calls were parsed out)
    messages: Optional[list[dict[str, Any]]] = None  # chat: the request's messages (openai_api.parse_messages form)
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


def _comparable(message: dict[str, Any]) -> dict[str, Any]:
    """A message as far as the model's tokens go: tool-call ids are the client's bookkeeping."""
    if not message.get("tool_calls"):
        return message
    return {**message, "tool_calls": [{k: v for k, v in call.items() if k != "id"} for call in message["tool_calls"]]}


class _Episode:
    """One agent run: answers its client's requests and records them."""

    def __init__(self, workflow: "OpenAIAgentWorkflow", engine, data: dict[str, Any], sample_idx: int):
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

    def _with_defaults(self, body: dict, sampling: Sampling) -> Sampling:
        """The request's sampling with `rollout.gconfig`'s values where the agent set none, and always its
        temperature (greedy in evaluation)."""
        g = self.workflow.gconfig

        def given(*names: str) -> bool:
            return any(body.get(name) is not None for name in names)

        return dataclasses.replace(
            sampling,
            max_tokens=sampling.max_tokens if given("max_tokens", "max_completion_tokens") else g.max_new_tokens,
            # the trainer recomputes logprobs at the config's temperature: an agent's own would make them disagree
            temperature=0.0 if g.greedy else g.temperature,
            top_p=sampling.top_p if given("top_p") else g.top_p,
            top_k=sampling.top_k if given("top_k") else g.top_k,
            stop=sampling.stop if given("stop") else list(g.stop),
            stop_token_ids=sampling.stop_token_ids if given("stop_token_ids") else list(g.stop_token_ids))

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

    async def _generate(self, prompt_ids: list[int], sampling: Sampling, n: int) -> list[ModelResponse]:
        gconfig = GenerationConfig(n_samples=1, max_new_tokens=sampling.max_tokens, temperature=sampling.temperature,
                                   top_p=sampling.top_p, top_k=sampling.top_k, stop=list(sampling.stop),
                                   stop_token_ids=list(sampling.stop_token_ids))
        requests = []
        for choice in range(n):
            if sampling.seed is not None:
                seed = {"sampling_seed": (sampling.seed + choice) % (1 << 63)}
            else:
                seed = sample_seed(self.data, self.sample_idx, self.samples_drawn)
            self.samples_drawn += 1
            extra = {"min_p": sampling.min_p, "ignore_eos": sampling.ignore_eos,
                     "skip_special_tokens": sampling.skip_special_tokens, **seed}
            rid = self.rid if choice == 0 and not self.rid_in_use else uuid.uuid4().hex
            requests.append(ModelRequest(rid=rid, input_ids=list(prompt_ids), gconfig=gconfig,
                                         extra_sampling_params=extra))
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


class _InProcessTransport(httpx2.AsyncBaseTransport):
    """The agent's client's HTTP: each request answered by its episode, in this process."""

    def __init__(self, episode: _Episode):
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
            return httpx2.Response(200, json=await route(body))
        except OpenAIError as e:
            return httpx2.Response(e.status, json=e.body())
        except Exception as e:
            # The rollout fails with this whatever the agent does; the agent sees what a lost server looks like
            # through the SDK (APIConnectionError).
            self.episode.failure = self.episode.failure or e
            raise httpx2.TransportError(f"{type(e).__name__}: {e}") from e


class OpenAIAgentWorkflow:
    def __init__(self, agent: Agent, gconfig: GenerationConfig, tokenizer, *, entry: str = "",
                 turn_discount: float = 0.9, export_style: str = "concat", model_name: str = ""):
        if export_style not in EXPORT_STYLES:
            raise ValueError(f"agent.export_style must be one of {EXPORT_STYLES}, got {export_style!r}")
        self.agent = agent
        self.entry = entry or getattr(agent, "__qualname__", repr(agent))
        self.gconfig = gconfig
        self.tokenizer = tokenizer
        self.turn_discount = turn_discount
        self.export_style = export_style
        self.model_name = model_name or getattr(tokenizer, "name_or_path", "") or "default"

    async def arun_episode(self, engine, data: dict[str, Any]) -> list[Trajectory]:
        runs = await asyncio.gather(*(self._run_agent(engine, data, i) for i in range(self.gconfig.n_samples)))
        return [t for trajectories in runs for t in trajectories]

    async def _run_agent(self, engine, data: dict[str, Any], sample_idx: int) -> list[Trajectory]:
        episode = _Episode(self, engine, data, sample_idx)
        # No retries in the client: the inference client retries the servers itself, and a refused request stays one.
        client = AsyncOpenAI(base_url=BASE_URL, api_key="areal-pipeline", max_retries=0,
                             http_client=httpx2.AsyncClient(transport=_InProcessTransport(episode), base_url=BASE_URL,
                                                            timeout=None))
        try:
            returned = await self.agent(client, copy.deepcopy(data))
        except Exception as e:
            if episode.failure is not None:
                raise episode.failure from e
            raise AgentError(f"agent {self.entry} failed on prompt {data.get('prompt_id')} (sample {sample_idx}): "
                             f"{type(e).__name__}: {e}") from e
        finally:
            await client.close()
        if episode.failure is not None:  # the agent went on without a completion it asked for: nothing to train on
            raise episode.failure
        try:
            trajectories = episode.trajectories(returned)
        except (TypeError, ValueError) as e:
            raise AgentError(f"agent {self.entry} on prompt {data.get('prompt_id')} returned {returned!r}: {e}") from e
        if not trajectories:
            logger.warning("agent %s made no completion on prompt %s: the episode trains nothing", self.entry,
                           data.get("prompt_id"))
        return trajectories
