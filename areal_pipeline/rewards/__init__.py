"""Rewards: answer checkers, and a process pool that runs them with a timeout."""

from areal_pipeline.rewards.math import extract_answer, extract_reference, math_reward
from areal_pipeline.rewards.pool import RewardPool

__all__ = ["RewardPool", "extract_answer", "extract_reference", "math_reward"]
