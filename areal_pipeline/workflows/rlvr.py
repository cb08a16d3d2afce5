"""Single-turn RL with verifiable rewards (AReaL's RLVRWorkflow): one completion of the prompt, scored.

An episode is one generation, scored by the reward function in the reward pool, as one trajectory. The rollout plays
`rollout.gconfig.n_samples` of them per prompt at once (GRPO's group; rollout/group.py), their first requests sent to
the server together.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import uuid
from typing import TYPE_CHECKING, Any, Callable

from areal_pipeline.data.trajectory import NO_VERSION, Trajectory
from areal_pipeline.inference.types import ModelRequest, ModelResponse, SamplingParams

if TYPE_CHECKING:
    from areal_pipeline.config import GenerationConfig
    from areal_pipeline.rewards.pool import RewardPool

# Chat prompts whose token ids are remembered: a data set's prompts repeat every epoch, and a GSM8K-sized train
# split fits.
PROMPT_CACHE_SIZE = 65536


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a chat prompt, ending with the assistant's turn header. Remembered per tokenizer and
    messages: data sets repeat prompts across iterations and epochs, and rendering the template is the main
    client-side cost of a prompt."""
    return list(_templated_ids(tokenizer, json.dumps(messages, sort_keys=True)))


@functools.lru_cache(maxsize=PROMPT_CACHE_SIZE)
def _templated_ids(tokenizer, messages_json: str) -> tuple[int, ...]:
    return tuple(tokenizer.apply_chat_template(json.loads(messages_json), add_generation_prompt=True, tokenize=True,
                                               return_dict=False))


def sample_seed(data: dict[str, Any], turn: int = 0) -> dict[str, int]:
    """`sampling_seed` for generation `turn` of an episode, when the rollout gave the episode a seed: the same
    iteration then samples the same tokens however the server batches it (so a rerun reproduces its shards)."""
    if data.get("sampling_seed") is None:
        return {}
    return {"sampling_seed": (int(data["sampling_seed"]) + 7919 * turn) % (1 << 31)}


def single_turn_trajectory(data: dict[str, Any], resp: ModelResponse, reward: float, completion: str) -> Trajectory:
    prompt_len = resp.input_len
    return Trajectory(
        prompt_id=data["prompt_id"],
        group_id=data["prompt_id"],
        sample_idx=data.get("sample_idx", 0),
        input_ids=resp.input_tokens + resp.output_tokens,
        loss_mask=[0] * prompt_len + [1] * resp.output_len,
        logprobs=[0.0] * prompt_len + resp.output_logprobs,
        versions=[NO_VERSION] * prompt_len + resp.output_versions,
        reward=reward,
        num_turns=1,
        stop_reason=resp.stop_reason,
        messages=data["messages"] + [{"role": "assistant", "content": completion}],
        text=completion,
        metadata={"answer": data.get("answer"), "latency": resp.latency, "server": resp.server},
    )


class RLVRWorkflow:
    config_class = None  # no rollout.agent keys of its own
    reward_function = "areal_pipeline.rewards.math:math_reward"
    tools = ()

    def __init__(self, reward_fn: Callable[[str, Any], float], gconfig: "GenerationConfig", tokenizer,
                 reward_pool: "RewardPool"):
        self.reward_fn = reward_fn
        self.gconfig = gconfig
        self.sampling = SamplingParams.from_config(gconfig)
        self.tokenizer = tokenizer
        self.reward_pool = reward_pool

    @classmethod
    def from_config(cls, cfg, tokenizer, reward_pool, *, reward_fn, tool_addresses):
        return cls(reward_fn, cfg.rollout.gconfig, tokenizer, reward_pool)

    def request(self, data: dict[str, Any]) -> ModelRequest:
        """The episode's one generation: its own trajectory (rid) and seed."""
        return ModelRequest(rid=uuid.uuid4().hex, input_ids=chat_prompt_ids(self.tokenizer, data["messages"]),
                            sampling=dataclasses.replace(self.sampling, **sample_seed(data)))

    async def arun_episode(self, engine, data: dict[str, Any]) -> Trajectory:
        resp = await engine.agenerate(self.request(data))
        completion = self.tokenizer.decode(resp.output_tokens, skip_special_tokens=True)
        reward = await self.reward_pool.ascore(self.reward_fn, completion, data["answer"])
        return single_turn_trajectory(data, resp, reward, completion)
