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
import contextlib
import dataclasses
from typing import Any, Awaitable, Callable, Optional

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
                     refill: Optional[Callable[[int, int], dict[str, Any]]] = None,
                     judge: Optional[Callable[[Any, dict[str, Any]], Awaitable[Any]]] = None,
                     gate: Optional[asyncio.Semaphore] = None, played: Optional[Any] = None) -> Any:
    """The group of prompt `data` (batch position `slot`) under the failure policy `policy` (failures.FailurePolicy):
    a `failures.GroupResult`. `recover`, where given, is awaited before an episode that failed at an inference server
    is played again (it brings a restarted server back to the expected weights). `refill(slot, j)` gives the j-th
    reserve prompt of a group that `on_failure=refill` replaces.

    Each episode (and the baseline's) plays in its own attempts: a failure that classify() calls retryable is played
    again, from a fresh `arun_episode` with the same seed (so a retry that succeeds makes the tokens an undisturbed
    run makes), after `episode_retry_delay` seconds, doubling; each attempt has `episode_timeout` seconds. Its
    siblings go on meanwhile. An error classify() does not call an episode's fault fails the group as itself.

    `judge(result, record)` (judging.judge_group, bound to the run's group reward) scores every group played, a
    reserve's too, before the policy decides: a group it could not score is a failed group like any other. `played`:
    the group's episodes played already (a group on disk awaiting its scores): judged, not played again. `gate` is
    held while episodes play, not while they are judged (the batch's bound on groups in flight)."""
    from areal_pipeline.rollout.failures import EpisodesFailed, GroupResult, describe_failures

    if policy is not None and policy.on_failure == "refill" and refill is None:
        raise ValueError("rollout.on_failure=refill: the rollout passes no refill(slot, j) to take reserve prompts "
                         "from")

    async def play(record: dict[str, Any]) -> Any:
        async with gate or contextlib.nullcontext():
            return await _play(workflow, engine, record, n_samples, baseline, slot, policy, recover)

    async def judged(result: Any, record: dict[str, Any]) -> Any:
        return await judge(result, record) if judge is not None else result

    result = await judged(played if played is not None else await play(data), data)
    if policy is None or not result.failures:  # policy None: strict (run_group, run_episodes)
        return result
    if policy.on_failure == "fail":
        first = result.failures[0]
        raise EpisodesFailed(f"prompt {data.get('prompt_id')} (slot {slot}), sample {first.sample_idx}: "
                             f"{describe_failures(result.failures)}; after {first.attempt} attempt(s): {first.message}")
    if policy.on_failure == "refill":
        failures, retried, episodes = list(result.failures), list(result.retried), result.episodes
        for j in range(REFILL_TRIES):
            reserve = refill(slot, j)
            tried = await play(reserve)
            failures += tried.failures
            retried += tried.retried
            episodes += tried.episodes
            if tried.failures:
                continue
            refilled = await judged(GroupResult(slot, reserve.get("prompt_id"), tried.trajectories, list(failures),
                                                list(retried), "refilled", replaced_prompt_id=data.get("prompt_id"),
                                                episodes=episodes), reserve)
            if not refilled.judge_failed:
                return refilled
            failures, retried = list(refilled.failures), list(refilled.retried)
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
    tasks = [asyncio.ensure_future(attempts(play, policy, what=f"episode {i}", sample_idx=i, prompt_id=prompt_id,
                                            recover=recover, timeout=policy.episode_timeout if policy else 0.0))
             for i, play in enumerate(players)]
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


async def attempts(play: Callable[[], Any], policy: Any, *, what: str, sample_idx: int = -1, prompt_id: Any = None,
                   recover: Optional[Any] = None, timeout: float = 0.0, cause: Optional[str] = None
                   ) -> tuple[Any, list, Any]:
    """`play()` under the failure policy `policy`: (its result or None, the failed attempts a later one got past, the
    failure that ended it or None). `what` names it in the log ("episode 2", "the group reward's scores"). A failure
    classify() calls retryable is tried again up to `episode_retries` times, after `episode_retry_delay` seconds
    doubling (and `recover()` first where it failed at an inference server); each attempt has `timeout` seconds (0:
    no limit). `cause`, where given, is every failure's cause in place of the one classify() reads from the error.
    An error classify() does not call an episode's fault is raised as itself, as is every error where `policy` is
    None."""
    from areal_pipeline.rollout.failures import MESSAGE_CHARS, EpisodeFailure, classify

    if policy is None:  # strict: the error as itself
        return await play(), [], None
    retried: list[EpisodeFailure] = []
    for attempt in range(1, policy.episode_retries + 2):
        try:
            async with asyncio.timeout(timeout or None) as limit:
                return await play(), retried, None
        except Exception as error:
            if limit.expired():
                failure = EpisodeFailure("episode_timeout", True,
                                         f"the episode ran past rollout.episode_timeout={timeout:g} s"[:MESSAGE_CHARS])
            else:
                failure = classify(error)
                if failure is None:
                    raise
        failure = dataclasses.replace(failure, cause=cause or failure.cause, sample_idx=sample_idx, attempt=attempt,
                                      prompt_id=prompt_id)
        if not failure.retryable or attempt > policy.episode_retries:
            return None, retried, failure
        retried.append(failure)
        logger.warning("%s of prompt %s failed (%s: %s); attempt %d of %d in %g s", what, prompt_id,
                       failure.where(), failure.message, attempt + 1, policy.episode_retries + 1,
                       policy.episode_retry_delay * 2 ** (attempt - 1))
        await asyncio.sleep(policy.episode_retry_delay * 2 ** (attempt - 1))
        if failure.cause == "inference" and recover is not None:
            await recover()
    raise AssertionError("unreachable: the last attempt returns")
