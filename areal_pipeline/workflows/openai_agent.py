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
and is answered in OpenAI's format by `inference/openai_*.py` (chat template, sampling fields, Qwen `<tool_call>`
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
since the trainer recomputes logprobs at that temperature. An episode is one run of the agent; the rollout runs
`gconfig.n_samples` of them per prompt (the GRPO group, `group_id` = the prompt), and each request is seeded from the
episode's seed unless the agent gives `seed`.

Failures: an agent that raises fails its episode with an AgentError naming the prompt; the rollout's failure policy
(rollout/failures.py, `rollout.on_failure`) plays the episode again when the agent's own exception may pass (a
connection error, a timeout; not a ValueError), else drops, masks or refills its group. A failure of the inference
servers reaches the rollout as itself (cause `inference`, the server named), whatever the agent made of it. A
request the server refuses (a conversation outgrowing the context) reaches the agent as `openai.BadRequestError`,
for it to handle.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
from typing import TYPE_CHECKING, Any, Awaitable, Callable, ClassVar, Iterator

from areal_pipeline.config import one_of, within
from areal_pipeline.data.trajectory import Trajectory
from areal_pipeline.user_code import is_reference, load_attr, reference_form
from areal_pipeline.utils import get_logger

if TYPE_CHECKING:
    from openai import AsyncOpenAI

    from areal_pipeline.config import GenerationConfig

logger = get_logger(__name__)

Agent = Callable[["AsyncOpenAI", dict], Awaitable[Any]]
EXPORT_STYLES = ("concat", "individual")


@dataclasses.dataclass
class OpenAIAgentConfig:
    """rollout.agent of rollout.workflow=openai_agent."""

    # openai_agent: the user's `async def agent(client: AsyncOpenAI, data: dict) -> float | dict[str, float]`, as
    # "module:function" (importable from the working directory) or "path/to/file.py:function"
    entry: str = ""
    # openai_agent: rewards discounted back over the completions, R_i = r_i + turn_discount * R_{i+1}
    turn_discount: float = 0.9
    # openai_agent's trajectories: concat (a conversation's completions as one sequence) | individual (one each)
    export_style: str = "concat"

    field_rules: ClassVar[dict] = {"turn_discount": within(0, 1), "export_style": one_of(*EXPORT_STYLES)}


class AgentError(RuntimeError):
    """The user's agent raised; its exception is the cause (and decides whether a retry may help:
    errors.is_transient)."""


@functools.lru_cache(maxsize=32)
def load_agent(entry: str) -> Agent:
    """The agent function named by `rollout.agent.entry`: 'module:function' or 'path/to/file.py:function'."""
    agent = load_attr(entry, "rollout.agent.entry", "function")
    if not (inspect.iscoroutinefunction(agent) or inspect.iscoroutinefunction(getattr(agent, "__call__", None))):
        raise TypeError(f"rollout.agent.entry={entry!r}: {getattr(agent, '__name__', agent)} must be an async "
                        "function agent(client: AsyncOpenAI, data: dict) -> float | dict[str, float]")
    return agent


class OpenAIAgentWorkflow:
    config_class = OpenAIAgentConfig
    reward_function = None  # the agent scores its own episodes
    tools = ()  # the agent calls its tools itself

    def __init__(self, agent: Agent, gconfig: "GenerationConfig", tokenizer, *, entry: str = "",
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

    @classmethod
    def from_config(cls, cfg, tokenizer, reward_pool, *, reward_fn, tool_addresses) -> "OpenAIAgentWorkflow":
        agent: OpenAIAgentConfig = cfg.rollout.agent
        return cls(load_agent(agent.entry), cfg.rollout.gconfig, tokenizer, entry=agent.entry,
                   turn_discount=agent.turn_discount, export_style=agent.export_style)

    @classmethod
    def config_problems(cls, cfg, key) -> Iterator[str]:
        """The agent must be named (whether it imports is the workflow's to find out when the run builds it)."""
        entry = cfg.rollout.agent.entry
        if not is_reference(entry) or not entry.rpartition(":")[2].isidentifier() or any(c.isspace() for c in entry):
            yield (f"{key('rollout.agent.entry')}={entry!r}: must name the agent as {reference_form('function')} "
                   "(rollout.workflow=openai_agent runs it)")

    async def arun_episode(self, engine, data: dict[str, Any]) -> list[Trajectory]:
        """One run of the agent: the trajectories of its conversations (`agent.export_style`)."""
        # the openai SDK and its HTTP library: imported once episodes run, not whenever a config loads
        from areal_pipeline.workflows.openai_recording import RecordingEpisode, recording_client

        sample_idx = data.get("sample_idx", 0)
        episode = RecordingEpisode(self, engine, data, sample_idx)
        client = recording_client(episode)
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
