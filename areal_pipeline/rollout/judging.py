"""A played group scored by the group reward (`rollout.group_reward`, rewards/group.py: the judge), under the rollout's
failure policy (`rollout.on_failure`, failures.py), as an episode's error is.

Each kept trajectory's reward becomes its group score; the workflow's own is kept as `metadata["workflow_reward"]`. A
group reward that fails (a judge that stays down past its own retries, an answer that is no scores) is asked again
`rollout.episode_retries` times, after `rollout.episode_retry_delay` seconds doubling. When those run out, every
episode of the group has failed with cause `judge`, and the policy decides: `drop` and `mask` drop the group (the
judge scores a group whole, so none of its episodes survives), `refill` plays a reserve prompt's group and judges it
in turn (group.play_group), `fail` fails the rollout node. A score is never made up. An error that is no episode's
fault (a judge that refuses the request: a wrong key, an unknown model) fails the node as itself.

A group is written to the episode journal unjudged before it is judged. A group the judge dropped is dropped in memory
only (`GroupResult.judge_failed`): its journal keeps it played and unjudged, so the node's retry (or a rerun) judges
it again and plays nothing again, even past `rollout.max_failure_rate` (journal.finish_rollout).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from areal_pipeline.data.trajectory import Trajectory
from areal_pipeline.rollout.failures import JUDGE_CAUSE, GroupResult
from areal_pipeline.rollout.group import attempts


async def judge_group(group_reward: Any, result: GroupResult, record: Optional[dict[str, Any]] = None, *,
                      policy: Any = None, on_group: Optional[Callable[[GroupResult], None]] = None) -> GroupResult:
    """`result` (a played group) scored by `group_reward` (rewards/group.GroupReward) under the failure policy `policy`
    (None: strict, the group reward's error raised as itself), or, where it failed for good, the group dropped with a
    `judge` failure per episode. `record` is the data set's record of the group's prompt (its question and reference
    answer), where at hand; else the trajectories' prompt and `metadata["answer"]`. With `on_group` (the episode
    journal's writer, called on the event loop: it must not block) the group is written, marked unjudged, before it
    is judged; what comes after is the caller's to write (but a group the judge dropped: executor.play_batch). The
    scored group is a new `GroupResult` of new trajectories: the one written stays unjudged. A group without
    trajectories is returned as it is."""
    group = result.trajectories
    if not group:  # a dropped group has nothing to score
        return result
    if any(t.token_returns is not None for t in group):
        raise TypeError("rollout.group_reward: the workflow's trajectories carry per-turn returns (token_returns), "
                        "which a group score cannot replace; use a workflow with one reward per trajectory")
    if any(t.baseline_reward is not None for t in group):
        raise TypeError("rollout.group_reward: the advantage's baseline episode (ReMax's greedy completion) is "
                        "scored by the workflow, not the group reward; use another ppo.advantage")
    if record is None or record.get("prompt_id") != result.prompt_id:  # a refilled group: the reserve's prompt
        record = {}
    # The journal encodes what it is handed later, from its own thread: what it holds must not change, so the
    # judged group is a new one (below), never this one scored in place.
    result = dataclasses.replace(result, judged=False)
    if on_group is not None:
        on_group(result)
    scores, retried, failure = await attempts(lambda: group_scores(group_reward, group, record), policy,
                                              what="the group reward's scores", prompt_id=result.prompt_id,
                                              cause=JUDGE_CAUSE)
    if failure is None:
        scored = [dataclasses.replace(t, reward=score, metadata={**t.metadata, "workflow_reward": t.reward})
                  for t, score in zip(group, scores)]
        return dataclasses.replace(result, trajectories=scored, judged=True, retried=[*result.retried, *retried])
    lost = [dataclasses.replace(failure, sample_idx=i) for i in sorted({t.sample_idx for t in group})]
    return GroupResult(result.slot, result.prompt_id, [], [*result.failures, *lost], [*result.retried, *retried],
                       "dropped", replaced_prompt_id=result.replaced_prompt_id, episodes=result.episodes)


async def group_scores(group_reward: Any, group: list[Trajectory], record: dict[str, Any]) -> list[float]:
    """`group_reward`'s scores of one prompt's trajectories (`record`: the prompt's data set record, {} where
    unknown), as the rollout and `areal-pipeline rescore` both ask for them."""
    scores = await group_reward.score_group([candidate(t, record) for t in group])
    if len(scores) != len(group):
        raise ValueError(f"the group reward gave {len(scores)} scores for the {len(group)} trajectories of prompt "
                         f"{group[0].prompt_id}")
    return [float(score) for score in scores]


def candidate(t: Trajectory, record: dict[str, Any]) -> Any:
    """What a group reward sees of trajectory `t` of the prompt `record` ({} where unknown)."""
    from areal_pipeline.rewards.group import Candidate

    question = record.get("question") or _first_user_message(record.get("messages") or t.messages)
    answer = record["answer"] if "answer" in record else t.metadata.get("answer")
    return Candidate(prompt_id=str(t.prompt_id), sample_idx=t.sample_idx, question=question, completion=t.text,
                     answer=answer, messages=list(t.messages))


def _first_user_message(messages: list[dict[str, Any]]) -> str:
    return next((str(m.get("content", "")) for m in messages if m.get("role") == "user"), "")
