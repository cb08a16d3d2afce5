"""Episodes that fail: what failed (a cause, the peer), whether playing the episode again can help, and what the
rollout does when an episode's retries run out (`rollout.on_failure`). A failed episode never becomes a reward of 0:
it is retried, or its group is dropped, masked or refilled, and every outcome is counted per iteration.

The interfaces here are shared by the synchronous rollout (executor.play_batch), the asynchronous one
(async_executor) and the episode journal (journal.py); the policy's logic lives in group.play_group.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from areal_pipeline.data.trajectory import Trajectory

ON_FAILURE = ("drop", "mask", "refill", "fail")
# the cause of a group's failure to get the group reward's scores (rollout.group_reward: the judge, rollout/judging.py)
JUDGE_CAUSE = "judge"
MESSAGE_CHARS = 300  # of an error's words kept per failure: the manifest and metrics stay small


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
    reward_crash, agent, episode_timeout; judge: its group's scores), whether another attempt may succeed, the peer
    that failed (an address, a worker) where known, and the error's own words."""

    cause: str
    retryable: bool
    message: str
    peer: Optional[str] = None
    sample_idx: int = -1
    attempt: int = 1
    prompt_id: Any = None  # the prompt whose episode failed (a refilled group's failures name two prompts)

    def as_record(self) -> dict[str, Any]:
        return {"cause": self.cause, "retryable": self.retryable, "message": self.message, "peer": self.peer,
                "sample_idx": self.sample_idx, "attempt": self.attempt, "prompt_id": self.prompt_id}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> "EpisodeFailure":
        return cls(**{key: record[key] for key in ("cause", "retryable", "message", "peer", "sample_idx",
                                                   "attempt", "prompt_id") if key in record})

    def where(self) -> str:
        return f"{self.cause} @{self.peer}" if self.peer else self.cause


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
    # episodes played (each counted once however many attempts it took; a refill's count too): the failure rate's
    # denominator. 0 where unknown (a result built elsewhere): then its kept trajectories' and failures' episodes
    episodes: int = 0
    # False between the end of its episodes and the group reward's scores (rollout.group_reward), so that a group
    # journaled then is judged, not played, again (judging.judge_group)
    judged: bool = True

    @property
    def judge_failed(self) -> bool:
        """Dropped for want of the group reward's scores (rollout/judging.py). Such a group is dropped in memory only:
        the episode journal keeps its record as played and unjudged, so that the node's retry or a rerun judges it
        again and plays nothing again."""
        return self.outcome == "dropped" and any(f.cause == JUDGE_CAUSE for f in self.failures)

    def episodes_played(self) -> int:
        if self.episodes:
            return self.episodes
        return len({t.sample_idx for t in self.trajectories}) + len(self.failures)


class RolloutFailureRate(RuntimeError):
    """More of an iteration's episodes failed for good than `rollout.max_failure_rate` allows."""


class EpisodesFailed(RuntimeError):
    """`rollout.on_failure=fail`: an episode's retries ran out (the message names the cause and the peer)."""


def classify(error: BaseException) -> Optional[EpisodeFailure]:
    """What an episode's error means for the episode (the cause, the peer, whether another attempt may pass), or
    None when it is no fault of the episode and must fail the rollout as itself: a configuration or data error, a
    reward function that cannot load, a workflow returning the wrong type, the node's deadline, a cancellation."""
    from areal_pipeline.errors import PermanentError, is_transient
    from areal_pipeline.inference.adapters import not_loaded
    from areal_pipeline.inference.client import InferenceServerError
    from areal_pipeline.rewards.pool import RewardCrash, RewardError, RewardLoadError, RewardTimeout
    from areal_pipeline.tools.retrieval_client import RetrievalError
    from areal_pipeline.utils import DeadlineExceeded

    if not isinstance(error, Exception) or isinstance(error, asyncio.CancelledError):
        return None  # KeyboardInterrupt, SystemExit, cancellation: the rollout is stopping
    if isinstance(error, (DeadlineExceeded, PermanentError, RewardLoadError, TypeError)):
        return None
    message = f"{type(error).__name__}: {error}"[:MESSAGE_CHARS]
    if isinstance(error, InferenceServerError):
        # a 4xx is the server refusing this request (a prompt past its context): the same seed is refused again;
        # but a server without the run's LoRA adapter (restarted on its base) takes it once recovery pushed it again
        transient = is_transient(error) or not_loaded(error)
        return EpisodeFailure("inference" if transient else "inference_refused", transient, message, error.address)
    if isinstance(error, RetrievalError):
        return EpisodeFailure("retrieval", is_transient(error), message, getattr(error, "address", None))
    if isinstance(error, RewardTimeout):
        return EpisodeFailure("reward_timeout", True, message, error.peer)
    if isinstance(error, RewardCrash):
        return EpisodeFailure("reward_crash", True, message, error.peer)
    if isinstance(error, RewardError):
        # the user's reward code raised on this answer: it raises again on the same tokens
        return EpisodeFailure("reward_error", False, message, error.peer)
    # any other error a workflow raised (an OpenAI agent's AgentError, whose cause is the agent's exception) is the
    # agent's, retried when it may pass (a ValueError will not); a wait on another process that ran out
    # (utils.PeerTimeout) names that process
    peer = getattr(error, "peer", None)
    return EpisodeFailure("agent", is_transient(error), message, peer if isinstance(peer, str) else None)


def _failed_groups(groups: Iterable[GroupResult]) -> list[tuple[GroupResult, EpisodeFailure]]:
    return [(group, failure) for group in groups for failure in group.failures]


def failure_stats(groups: Iterable[GroupResult]) -> dict[str, float]:
    """An iteration's failure metrics: `failure_rate` (episodes failed for good / episodes played),
    `groups_dropped`, `groups_refilled`, `episodes_masked` always; `failures/<cause>` (episodes failed for good) and
    `retries/<cause>` (failed attempts a retry got past) where not 0."""
    groups = list(groups)
    failed = Counter(f.cause for g in groups for f in g.failures)
    retried = Counter(f.cause for g in groups for f in g.retried)
    played = sum(g.episodes_played() for g in groups)
    return {
        "failure_rate": sum(failed.values()) / played if played else 0.0,
        "groups_dropped": sum(g.outcome == "dropped" for g in groups),
        "groups_refilled": sum(g.outcome == "refilled" for g in groups),
        "episodes_masked": sum(len(g.failures) for g in groups if g.outcome == "masked"),
        **{f"failures/{cause}": n for cause, n in sorted(failed.items())},
        **{f"retries/{cause}": n for cause, n in sorted(retried.items())},
    }


def failure_records(groups: Iterable[GroupResult]) -> list[dict[str, Any]]:
    """The episodes that failed for good, for the rollout's manifest: slot, prompt_id, sample_idx, cause, peer,
    attempt (the last one's number) and message."""
    return [{"slot": g.slot, "prompt_id": f.prompt_id if f.prompt_id is not None else g.prompt_id,
             "sample_idx": f.sample_idx, "cause": f.cause, "peer": f.peer, "attempt": f.attempt,
             "message": f.message} for g, f in _failed_groups(groups)]


def describe_failures(failures: Iterable[EpisodeFailure]) -> str:
    """"retrieval 5 @127.0.0.1:8123 'HTTP 503 ...', agent 2": per cause (most first) its count, its most frequent
    peer and that peer's first message."""
    failures = list(failures)
    parts = []
    for cause, n in Counter(f.cause for f in failures).most_common():
        of_cause = [f for f in failures if f.cause == cause]
        peer, _ = Counter(f.peer for f in of_cause).most_common(1)[0]
        part = f"{cause} {n}"
        if peer:
            first = next(f for f in of_cause if f.peer == peer)
            part += f" @{peer} {first.message[:120]!r}"
        parts.append(part)
    return ", ".join(parts)


def check_failure_rate(iteration: int, groups: Iterable[GroupResult], policy: FailurePolicy) -> None:
    """Raise RolloutFailureRate, naming the causes and the peers, when more of iteration `iteration`'s episodes
    failed for good than `policy.max_failure_rate` allows."""
    groups = list(groups)
    failures = [f for _, f in _failed_groups(groups)]
    played = sum(g.episodes_played() for g in groups)
    if played and len(failures) / played > policy.max_failure_rate:
        raise RolloutFailureRate(f"iteration {iteration}: {len(failures)}/{played} episodes failed: "
                                 f"{describe_failures(failures)} (more than rollout.max_failure_rate="
                                 f"{policy.max_failure_rate:g})")
