"""Episodes that fail: what failed (a cause, the peer), whether playing the episode again can help, and what the
rollout does when an episode's retries run out (`rollout.on_failure`). A failed episode never becomes a reward of 0:
it is retried, or its group is dropped, masked or refilled, and every outcome is counted per iteration.

The interfaces here are shared by the synchronous rollout (executor.play_batch), the asynchronous one
(async_executor) and the episode journal (journal.py); the policy's logic lives in group.play_group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from areal_pipeline.data.trajectory import Trajectory

ON_FAILURE = ("drop", "mask", "refill", "fail")


@dataclass(frozen=True)
class FailurePolicy:
    """`rollout.episode_retries` ... `rollout.max_failure_rate` (config/schema.py) as the executors use them."""

    episode_retries: int = 2
    episode_retry_delay: float = 1.0
    episode_timeout: float = 1800.0  # 0: no per-attempt limit
    on_failure: str = "drop"
    min_group_survivors: int = 2
    max_failure_rate: float = 0.2

    @classmethod
    def of(cls, rollout: Any) -> "FailurePolicy":
        """The policy of a `RolloutConfig`."""
        return cls(episode_retries=rollout.episode_retries, episode_retry_delay=rollout.episode_retry_delay,
                   episode_timeout=rollout.episode_timeout, on_failure=rollout.on_failure,
                   min_group_survivors=rollout.min_group_survivors, max_failure_rate=rollout.max_failure_rate)


@dataclass(frozen=True)
class EpisodeFailure:
    """One failed attempt at an episode: `cause` (inference, inference_refused, retrieval, tool, reward_timeout,
    reward_crash, agent, episode_timeout), whether another attempt may succeed, the peer that failed (an address, a
    worker) where known, and the error's own words."""

    cause: str
    retryable: bool
    message: str
    peer: Optional[str] = None
    sample_idx: int = -1
    attempt: int = 1

    def as_record(self) -> dict[str, Any]:
        return {"cause": self.cause, "retryable": self.retryable, "message": self.message, "peer": self.peer,
                "sample_idx": self.sample_idx, "attempt": self.attempt}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "EpisodeFailure":
        return cls(**{key: record[key] for key in ("cause", "retryable", "message", "peer", "sample_idx",
                                                   "attempt") if key in record})


@dataclass
class GroupResult:
    """A prompt's group after the failure policy: `slot` is its position in the iteration's batch; `trajectories`
    are the kept ones (empty when dropped); `failures` the episodes whose retries ran out, `retried` the failed
    attempts a later attempt got past; `outcome` ok | masked | dropped | refilled (then `prompt_id` is the reserve
    prompt's and `replaced_prompt_id` the batch's)."""

    slot: int
    prompt_id: Any
    trajectories: list[Trajectory]
    failures: list[EpisodeFailure] = field(default_factory=list)
    retried: list[EpisodeFailure] = field(default_factory=list)
    outcome: str = "ok"
    replaced_prompt_id: Any = None


class RolloutFailureRate(RuntimeError):
    """More of an iteration's episodes failed for good than `rollout.max_failure_rate` allows."""


class EpisodesFailed(RuntimeError):
    """`rollout.on_failure=fail`: an episode's retries ran out (the message names the cause and the peer)."""
