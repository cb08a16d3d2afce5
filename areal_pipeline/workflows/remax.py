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

import dataclasses
import uuid
from typing import Any, Iterator

from areal_pipeline.data.trajectory import Trajectory
from areal_pipeline.inference.types import ModelRequest
from areal_pipeline.workflows.rlvr import RLVRWorkflow, single_turn_trajectory


class ReMaxWorkflow(RLVRWorkflow):
    @classmethod
    def config_problems(cls, cfg, key) -> Iterator[str]:
        """ReMax's advantage is reward(sample) - reward(greedy), unnormalised, for the REINFORCE loss; PPO's clipped
        ratio would clip the +-1 signals it is made of."""
        if cfg.ppo.loss == "ppo":
            yield (f"{key('ppo.loss')}='ppo': must be reinforce (or a loss of your own, module:attr) with "
                   f"{key('rollout.workflow')}=remax")

    async def arun_episode(self, engine, data: dict[str, Any]) -> list[Trajectory]:
        requests = self.group_requests(data)
        # With greedy sampling (evaluation) the samples are their own baseline.
        if not self.gconfig.greedy:
            greedy = dataclasses.replace(requests[0].sampling, temperature=0.0, sampling_seed=None)
            requests.append(ModelRequest(rid=uuid.uuid4().hex, input_ids=requests[0].input_ids, sampling=greedy))
        responses, texts, rewards = await self.generate_and_score(engine, data, requests)
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
