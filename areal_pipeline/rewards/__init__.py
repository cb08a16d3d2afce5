"""Rewards: answer checkers, and a process pool that runs them with a timeout."""

from areal_pipeline.rewards.math import extract_answer, extract_reference, math_reward
from areal_pipeline.rewards.pool import RewardPool
from areal_pipeline.rewards.qa import exact_match_reward, f1_reward, normalize_answer

__all__ = ["RewardPool", "exact_match_reward", "extract_answer", "extract_reference", "f1_reward", "math_reward",
           "normalize_answer"]
