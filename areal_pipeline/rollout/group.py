"""One prompt's group: the executor, not the workflow, runs `rollout.gconfig.n_samples` episodes of a prompt.

A workflow plays one episode (`arun_episode(engine, data)`); `run_group` plays the group at once. Episode i of a
prompt sees the prompt's record plus `sample_idx` = i and its own `sampling_seed` (derived from the prompt's, so a
rerun samples the same tokens), and its trajectories get `group_id` = the prompt and `sample_idx` = i, in the order
of i. Where the advantage asks for a baseline (ReMax's greedy completion, `Advantage.greedy_baseline`), one more
episode of a baseline workflow runs beside them; its trajectories are not kept, its reward is: every trajectory of
the group records it as `baseline_reward`.

The episodes of one group share a `GroupEngine`: the generations they ask for in the same turn of the event loop
(a group's first turns, typically) reach one server as one batched call, as a workflow that sampled its group itself
sent them, rather than one HTTP request each.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Callable, Optional

from areal_pipeline.data.trajectory import Trajectory
from areal_pipeline.utils import get_logger

logger = get_logger(__name__)

# Sample i of an episode seeded s samples with seed s + SAMPLE_STRIDE * i (and a workflow's turn t adds its own
# stride, rlvr.sample_seed): the seeds of one prompt's samples never coincide.
SAMPLE_STRIDE = 1009
SEED_RANGE = 1 << 31


def episode_data(data: dict[str, Any], sample_idx: int) -> dict[str, Any]:
    """What episode `sample_idx` of the prompt `data` sees: the record, its index in the group and, when the
    rollout seeded the prompt, its own seed."""
    episode = {**data, "sample_idx": sample_idx}
    if data.get("sampling_seed") is not None:
        episode["sampling_seed"] = (int(data["sampling_seed"]) + SAMPLE_STRIDE * sample_idx) % SEED_RANGE
    return episode


def episode_trajectories(result: Any, workflow: Any) -> list[Trajectory]:
    """An episode's result as a list: a workflow returns one Trajectory, or a list of them (e.g. an OpenAI agent's
    conversations)."""
    if isinstance(result, Trajectory):
        return [result]
    if isinstance(result, (list, tuple)) and all(isinstance(t, Trajectory) for t in result):
        return list(result)
    raise TypeError(f"{type(workflow).__name__}.arun_episode returned {type(result).__name__}, not a Trajectory or "
                    "a list of them (areal_pipeline/workflows/protocol.py)")


async def run_group(workflow: Any, engine: Any, data: dict[str, Any], n_samples: int,
                    baseline: Optional[Any] = None) -> list[Trajectory]:
    """The trajectories of `n_samples` episodes of `workflow` on the prompt `data`, episode by episode; with
    `baseline` (a workflow), each also carries the mean reward of one episode of it as `baseline_reward`. An episode
    that fails fails the group with its own error (no retries: `play_group` is the rollout's, with its policy)."""
    return (await play_group(workflow, engine, data, n_samples, baseline, slot=0, policy=None)).trajectories


class GroupEngine:
    """The engine a group's episodes see: `agenerate` and `agenerate_group` calls made in the same turn of the event
    loop are sent together, as one `agenerate_group` of the engine (one server, one request per round); every other
    attribute is the engine's."""

    def __init__(self, engine: Any):
        self.engine = engine
        self._queued: list[tuple[list, asyncio.Future]] = []
        self._sending: set[asyncio.Task] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def agenerate(self, req):
        return (await self.agenerate_group([req]))[0]

    async def agenerate_group(self, reqs: list) -> list:
        future = asyncio.get_running_loop().create_future()
        if not self._queued:
            asyncio.get_running_loop().call_soon(self._send_queued)
        self._queued.append((list(reqs), future))
        return await future

    def _send_queued(self) -> None:
        queued, self._queued = self._queued, []
        task = asyncio.ensure_future(self._send(queued))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, queued: list[tuple[list, asyncio.Future]]) -> None:
        waiting = [(reqs, future) for reqs, future in queued if not future.done()]  # a cancelled episode's are dropped
        if not waiting:
            return
        try:
            responses = await self.engine.agenerate_group([req for reqs, _ in waiting for req in reqs])
        except asyncio.CancelledError:
            for _, future in waiting:
                future.cancel()
            raise
        except Exception as error:
            if len(waiting) > 1:
                # A request the server refuses (a conversation outgrowing the context) fails the batched call for
                # every episode in it: each episode's requests go again on their own, so only its episode sees it.
                await asyncio.gather(*(self._send([entry]) for entry in waiting))
                return
            for _, future in waiting:
                if not future.done():
                    future.set_exception(error)
            return
        start = 0
        for reqs, future in waiting:
            if not future.done():
                future.set_result(responses[start: start + len(reqs)])
            start += len(reqs)

    async def aclose(self) -> None:
        """Cancel the sends still in flight (their episodes are gone) and wait for them to end."""
        for task in list(self._sending):
            task.cancel()
        await asyncio.gather(*self._sending, return_exceptions=True)


REFILL_TRIES = 3  # reserve prompts tried, one after another, for a group that on_failure=refill replaces


async def play_group(workflow: Any, engine: Any, data: dict[str, Any], n_samples: int, baseline: Optional[Any] = None,
                     *, slot: int, policy: Any, recover: Optional[Any] = None,
                     refill: Optional[Callable[[int, int], dict[str, Any]]] = None) -> Any:
    """The group of prompt `data` (batch position `slot`) under the failure policy `policy` (failures.FailurePolicy):
    a `failures.GroupResult`. `recover`, where given, is awaited before an episode that failed at an inference server
    is played again (it brings a restarted server back to the expected weights). `refill(slot, j)` gives the j-th
    reserve prompt of a group that `on_failure=refill` replaces.

    Each episode (and the baseline's) plays in its own attempts: a failure that classify() calls retryable is played
    again, from a fresh `arun_episode` with the same seed (so a retry that succeeds makes the tokens an undisturbed
    run makes), after `episode_retry_delay` seconds, doubling; each attempt has `episode_timeout` seconds. Its
    siblings go on meanwhile. An error classify() does not call an episode's fault fails the group as itself."""
    from areal_pipeline.rollout.failures import EpisodesFailed, GroupResult, describe_failures

    if policy is None:  # strict (run_group, run_episodes)
        return await _play(workflow, engine, data, n_samples, baseline, slot, None, None)
    if policy.on_failure == "refill" and refill is None:
        raise ValueError("rollout.on_failure=refill: the rollout passes no refill(slot, j) to take reserve prompts "
                         "from")
    result = await _play(workflow, engine, data, n_samples, baseline, slot, policy, recover)
    if not result.failures:
        return result
    if policy.on_failure == "fail":
        first = result.failures[0]
        raise EpisodesFailed(f"prompt {data.get('prompt_id')} (slot {slot}), sample {first.sample_idx}: "
                             f"{describe_failures(result.failures)}; after {first.attempt} attempt(s): {first.message}")
    if policy.on_failure == "refill":
        failures, retried, episodes = list(result.failures), list(result.retried), result.episodes
        for j in range(REFILL_TRIES):
            reserve = refill(slot, j)
            tried = await _play(workflow, engine, reserve, n_samples, baseline, slot, policy, recover)
            failures += tried.failures
            retried += tried.retried
            episodes += tried.episodes
            if not tried.failures:
                return GroupResult(slot, reserve.get("prompt_id"), tried.trajectories, failures, retried, "refilled",
                                   replaced_prompt_id=data.get("prompt_id"), episodes=episodes)
        return GroupResult(slot, data.get("prompt_id"), [], failures, retried, "dropped", episodes=episodes)
    return result


async def _play(workflow: Any, engine: Any, data: dict[str, Any], n_samples: int, baseline: Optional[Any], slot: int,
                policy: Any, recover: Optional[Any]) -> Any:
    """One prompt's group, each episode in its own attempts (policy None: one attempt, its error raised as
    itself): outcome ok, masked (`on_failure=mask` and at least `min_group_survivors` episodes left) or dropped."""
    from areal_pipeline.rollout.failures import GroupResult

    if n_samples < 1:
        raise ValueError(f"a group needs at least one episode, got n_samples={n_samples}")
    prompt_id = data.get("prompt_id")
    shared = GroupEngine(engine)

    def player(agent: Any, episode: dict[str, Any]) -> Callable[[], Any]:
        return lambda: agent.arun_episode(shared, episode)

    players = [player(workflow, episode_data(data, i)) for i in range(n_samples)]
    if baseline is not None:
        unseeded = {key: value for key, value in data.items() if key != "sampling_seed"}
        players.append(player(baseline, {**unseeded, "sample_idx": n_samples}))
    tasks = [asyncio.ensure_future(_attempts(play, i, prompt_id, policy, recover)) for i, play in enumerate(players)]
    try:
        outcomes = await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # an error that is no episode's fault (or a cancellation): the siblings need not finish
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await shared.aclose()
    retried = [f for _, tries, _ in outcomes for f in tries]
    failures = [failure for _, _, failure in outcomes if failure is not None]
    group = []
    for i, (result, _, _) in enumerate(outcomes[:n_samples]):
        if result is None:
            continue
        for t in episode_trajectories(result, workflow):
            t.group_id, t.sample_idx = data.get("prompt_id", t.group_id), i
            group.append(t)
    if baseline is not None:
        result = outcomes[n_samples][0]
        if result is None:  # no baseline, no advantage for any of the group's episodes
            return GroupResult(slot, prompt_id, [], failures, retried, "dropped", episodes=len(players))
        rewards = [t.reward for t in episode_trajectories(result, baseline)]
        if not rewards:
            raise ValueError(f"the baseline episode of prompt {prompt_id} made no trajectory")
        for t in group:
            t.baseline_reward = sum(rewards) / len(rewards)
    if not failures:
        return GroupResult(slot, prompt_id, group, retried=retried, episodes=len(players))
    survivors = sum(result is not None for result, _, _ in outcomes[:n_samples])
    if policy.on_failure == "mask" and survivors >= policy.min_group_survivors:
        return GroupResult(slot, prompt_id, group, failures, retried, "masked", episodes=len(players))
    return GroupResult(slot, prompt_id, [], failures, retried, "dropped", episodes=len(players))


async def judge_group(group_reward: Any, result: Any, record: Optional[dict[str, Any]] = None,
                      on_group: Optional[Callable[[Any], None]] = None) -> Any:
    """Score a played group (a failures.GroupResult) with `group_reward` (rewards/group.GroupReward,
    `rollout.group_reward`): each kept trajectory's reward becomes its score, the workflow's own kept as
    `metadata["workflow_reward"]`. `record` is the data set's record of the group's prompt (its question and
    reference answer), where at hand; else the trajectories' prompt and `metadata["answer"]`.

    With `on_group` (the episode journal's writer), a group with trajectories is written before it is judged, marked
    unjudged, and every group once judged: a judge that stays down fails the rollout node (its error is transient),
    and the node's retry judges the journaled group without playing it again."""
    if result.trajectories:  # a dropped group has nothing to score
        result.judged = False
        if on_group is not None:
            await asyncio.to_thread(on_group, result)
        group = result.trajectories
        if any(t.token_returns is not None for t in group):
            raise TypeError("rollout.group_reward: the workflow's trajectories carry per-turn returns (token_returns), "
                            "which a group score cannot replace; use a workflow with one reward per trajectory")
        if any(t.baseline_reward is not None for t in group):
            raise TypeError("rollout.group_reward: the advantage's baseline episode (ReMax's greedy completion) is "
                            "scored by the workflow, not the group reward; use another ppo.advantage")
        if record is None or record.get("prompt_id") != result.prompt_id:  # a refilled group: the reserve's prompt
            record = {}
        for t, score in zip(group, await group_scores(group_reward, group, record)):
            t.metadata["workflow_reward"] = t.reward
            t.reward = score
    result.judged = True
    if on_group is not None:
        await asyncio.to_thread(on_group, result)
    return result


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


async def _attempts(play: Callable[[], Any], sample_idx: int, prompt_id: Any, policy: Any,
                    recover: Optional[Any]) -> tuple[Any, list, Any]:
    """(the episode's result or None, the failed attempts a later one got past, the failure that ended it or
    None)."""
    from areal_pipeline.rollout.failures import MESSAGE_CHARS, EpisodeFailure, classify

    if policy is None:  # run_group: the error as itself, its siblings cancelled
        return await play(), [], None
    retried: list[EpisodeFailure] = []
    for attempt in range(1, policy.episode_retries + 2):
        try:
            async with asyncio.timeout(policy.episode_timeout or None) as limit:
                return await play(), retried, None
        except Exception as error:
            if limit.expired():
                failure = EpisodeFailure("episode_timeout", True,
                                         f"the episode ran past rollout.episode_timeout={policy.episode_timeout:g} s"
                                         [:MESSAGE_CHARS])
            else:
                failure = classify(error)
                if failure is None:
                    raise
        failure = dataclasses.replace(failure, sample_idx=sample_idx, attempt=attempt, prompt_id=prompt_id)
        if not failure.retryable or attempt > policy.episode_retries:
            return None, retried, failure
        retried.append(failure)
        logger.warning("episode %d of prompt %s failed (%s: %s); attempt %d of %d in %g s", sample_idx, prompt_id,
                       failure.where(), failure.message, attempt + 1, policy.episode_retries + 1,
                       policy.episode_retry_delay * 2 ** (attempt - 1))
        await asyncio.sleep(policy.episode_retry_delay * 2 ** (attempt - 1))
        if failure.cause == "inference" and recover is not None:
            await recover()
    raise AssertionError("unreachable: the last attempt returns")
