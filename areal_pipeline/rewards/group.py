"""Group rewards: one call scores a prompt's whole group of episodes, relative to each other (a judge that ranks
them, as ART's RULER does), where a reward function (`reward(completion, answer) -> float`, rewards/pool.py) scores
one answer alone.

    rollout.group_reward: judge                 # or "module:attr" / "path/to/file.py:attr": a builder of your own

A builder makes the group reward from the run's config, `build(cfg) -> GroupReward`:

    GroupReward.score_group(candidates) -> list[float]     async; one score per candidate, in their order. A score
                                                            is never made up: a judge that cannot answer raises
                                                            (the rollout's failure policy decides, as for any
                                                            episode's error: rollout/judging.py), it never
                                                            returns 0
    GroupReward.take_usage() -> dict[str, float]            what the calls since the last take cost, as metrics
                                                            (e.g. judge/calls, judge/cache_hits, judge/prompt_tokens,
                                                            judge/completion_tokens, judge/cost_usd); {} for none
    GroupReward.aclose()                                    async; release connections

The rollout plays a prompt's group as ever, then replaces each trajectory's reward by its group score (the
workflow's own reward is kept in `metadata["workflow_reward"]`); `areal-pipeline rescore --group-reward` scores a
run's stored groups the same way, with no generation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

GROUP_REWARDS: dict[str, str] = {
    "judge": "areal_pipeline.rewards.judge:judge",
}


@dataclass(frozen=True)
class Candidate:
    """What a group reward sees of one episode."""

    prompt_id: str
    sample_idx: int
    question: str  # the bare question (the data set's), or the prompt's last user message where there is none
    completion: str  # the model's output as text (`Trajectory.text`)
    answer: Any = None  # the reference answer, where the data set has one
    messages: list[dict[str, Any]] = field(default_factory=list)  # the whole conversation, for multi-turn agents


@runtime_checkable
class GroupReward(Protocol):
    async def score_group(self, candidates: list[Candidate]) -> list[float]: ...

    def take_usage(self) -> dict[str, float]: ...

    async def aclose(self) -> None: ...


def group_reward_builder(name: str):
    """The builder `rollout.group_reward` (or `rescore --group-reward`) names: a registered name or "module:attr"."""
    from areal_pipeline.user_code import load_builder

    return load_builder(name, GROUP_REWARDS, "rollout.group_reward", "group reward", "areal_pipeline/rewards/group.py",
                        "GroupReward")


def make_group_reward(name: str, cfg: Any) -> GroupReward:
    """The group reward `name` names, built from the run's config `cfg`."""
    reward = group_reward_builder(name)(cfg)
    missing = [attr for attr in ("score_group", "take_usage", "aclose") if not hasattr(reward, attr)]
    if missing:
        raise TypeError(f"group reward '{name}': its builder returned {type(reward).__name__}, which lacks "
                        f"{', '.join(missing)} (areal_pipeline/rewards/group.py)")
    return reward
