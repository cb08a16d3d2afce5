"""Reward functions for the RewardPool tests, in a module that spawned workers can import."""

import time


def hang(*_args: object) -> float:
    time.sleep(60)
    return 1.0


def fail(*_args: object) -> float:
    raise ValueError("bad reward")


def hang_or_fail_on_marker(completion: str, answer: str) -> float:
    """Hangs on "hang", raises on "fail", else 1.0 when the completion is the answer."""
    if completion == "hang":
        time.sleep(60)
    if completion == "fail":
        raise ValueError("bad reward")
    return float(completion == answer)


def hang_after_writing_pid(path: str, *_args: object) -> float:
    """Writes its worker's pid to `path` (for a test to kill it mid-score), then hangs."""
    import os

    with open(path, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(60)
    return 1.0
