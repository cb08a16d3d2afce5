"""Math with reflection (AReaL's multi-turn math example): retry until right, for less reward each time.

While a turn's answer is wrong (the reward function on that turn's text) and turns remain
(`agent.max_turns`), a fixed user message asks the model to try again and it generates once more. The
episode's reward is the last turn's, times `agent.turn_discount` per extra turn. The turn loop is
`turns.FeedbackTurnsWorkflow`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from areal_pipeline.config import at_least, within
from areal_pipeline.workflows.turns import FeedbackTurnsWorkflow, Outcome

if TYPE_CHECKING:
    from areal_pipeline.config import GenerationConfig
    from areal_pipeline.rewards.pool import RewardPool

REFLECTION_MESSAGE = ("Your answer is either wrong or not parsable to the reward function. "
                      "Please try to answer it again.")


@dataclass
class ReflectionConfig:
    """rollout.agent of rollout.workflow=reflection."""

    # reflection: model turns per episode at most (the first answer and up to max_turns - 1 retries)
    max_turns: int = 2
    # reflection: the episode's reward is the last turn's x turn_discount per extra turn
    turn_discount: float = 0.9

    field_rules: ClassVar[dict] = {"max_turns": at_least(1), "turn_discount": within(0, 1)}


class ReflectionWorkflow(FeedbackTurnsWorkflow):
    config_class = ReflectionConfig
    reward_function = "areal_pipeline.rewards.math:math_reward"
    tools = ()

    def __init__(self, reward_fn: Callable[[str, Any], float], gconfig: "GenerationConfig", tokenizer,
                 reward_pool: "RewardPool", max_turns: int = 2, turn_discount: float = 0.9):
        super().__init__(reward_fn, gconfig, tokenizer, reward_pool, max_turns, (REFLECTION_MESSAGE,))
        self.message_ids = self.feedback_ids[REFLECTION_MESSAGE]
        self.turn_discount = turn_discount

    @classmethod
    def from_config(cls, cfg, tokenizer, reward_pool, *, reward_fn, tool_addresses) -> "ReflectionWorkflow":
        agent: ReflectionConfig = cfg.rollout.agent
        return cls(reward_fn, cfg.rollout.gconfig, tokenizer, reward_pool, max_turns=agent.max_turns,
                   turn_discount=agent.turn_discount)

    def feedback(self, turn: dict[str, Any]) -> str:
        return REFLECTION_MESSAGE

    def turn_fields(self, score: float) -> dict[str, Any]:
        return {"reward": score}

    def ends(self, turn: dict[str, Any]) -> bool:
        return turn["reward"] > 0

    def outcome(self, turns: list[dict[str, Any]]) -> Outcome:
        reward = turns[-1]["reward"]
        return Outcome(reward * self.turn_discount ** (len(turns) - 1),
                       {"first_turn_correct": turns[0]["reward"] > 0, "success": reward > 0, "num_turns": len(turns)})
