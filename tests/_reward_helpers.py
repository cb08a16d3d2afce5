"""Reward functions for the RewardPool tests, in a module that spawned workers can import."""

import time


def hang(*_args: object) -> float:
    time.sleep(60)
    return 1.0


def fail(*_args: object) -> float:
    raise ValueError("bad reward")
