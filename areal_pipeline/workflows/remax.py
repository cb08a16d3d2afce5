"""ReMax (Li et al. 2023): REINFORCE with the greedy completion's reward as the baseline.

For each prompt, `gconfig.n_samples` sampled completions (1 in the paper) and one greedy completion are
generated concurrently. Only the sampled ones are trained, each with advantage
`reward(sampled) - reward(greedy)` on every generated token.

How the advantage reaches the trainer unchanged: it is written as the trajectory's `token_returns`, which
the advantages step takes as the advantage before normalisation (no reward transform, normalisation or
discounting of its own); `configs/remax.yaml` turns `ppo.adv_norm` off and uses `ppo.loss: reinforce`.
`Trajectory.reward` stays the sampled completion's own reward, so reward curves and pass@1 mean what they
do for the other workflows; both raw rewards are kept in the metadata.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from typing import Any, Callable

from areal_pipeline.config import GenerationConfig
from areal_pipeline.data.trajectory import Trajectory
from areal_pipeline.inference.types import ModelRequest
from areal_pipeline.rewards.pool import RewardPool
from areal_pipeline.workflows.rlvr import chat_prompt_ids, sample_seed, single_turn_trajectory


class ReMaxWorkflow:
    def __init__(self, reward_fn: Callable[[str, Any], float], gconfig: GenerationConfig, tokenizer,
                 reward_pool: RewardPool):
        self.reward_fn = reward_fn
        self.gconfig = gconfig
        self.tokenizer = tokenizer
        self.reward_pool = reward_pool

    async def arun_episode(self, engine, data: dict[str, Any]) -> list[Trajectory]:
        input_ids = chat_prompt_ids(self.tokenizer, data["messages"])
        single = dataclasses.replace(self.gconfig, n_samples=1)
        requests = [ModelRequest(rid=uuid.uuid4().hex, input_ids=input_ids, gconfig=single,
                                 extra_sampling_params=sample_seed(data, i))
                    for i in range(self.gconfig.n_samples)]
        # With greedy sampling (evaluation) the samples are their own baseline.
        if not self.gconfig.greedy:
            requests.append(ModelRequest(rid=uuid.uuid4().hex, input_ids=input_ids,
                                         gconfig=dataclasses.replace(single, greedy=True)))
        responses = await asyncio.gather(*(engine.agenerate(r) for r in requests))
        texts = [self.tokenizer.decode(r.output_tokens, skip_special_tokens=True) for r in responses]
        rewards = await asyncio.gather(*(self.reward_pool.ascore(self.reward_fn, t, data["answer"]) for t in texts))
        n = self.gconfig.n_samples
        greedy_text, greedy_reward = (texts[n], rewards[n]) if len(texts) > n else (texts[0], rewards[0])
        trajectories = []
        for i in range(n):
            t = single_turn_trajectory(data, i, responses[i], rewards[i], texts[i])
            advantage = rewards[i] - greedy_reward
            t.metadata.update(reward_sampled=rewards[i], reward_greedy=greedy_reward, greedy_text=greedy_text,
                              advantage=advantage)
            trajectories.append(dataclasses.replace(t, token_returns=[advantage if m else 0.0 for m in t.loss_mask]))
        return trajectories
