"""Rewards: answer checkers, and a process pool that runs them with a timeout.

The checkers load on first use: a process that only hands a reward to the pool (the orchestrating one) never
imports math-verify and sympy (see pool.RewardReference)."""

from __future__ import annotations

import importlib
from typing import Any

from areal_pipeline.rewards.pool import RewardPool, RewardReference

_WHERE = {"extract_answer": "math", "extract_reference": "math", "math_reward": "math",
          "exact_match_reward": "qa", "f1_reward": "qa", "normalize_answer": "qa"}

__all__ = ["RewardPool", "RewardReference", *_WHERE]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"areal_pipeline.rewards.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'areal_pipeline.rewards' has no attribute {name!r}")
