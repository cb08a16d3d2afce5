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
from typing import Any, Optional

from areal_pipeline.data.trajectory import Trajectory

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
    `baseline` (a workflow), each also carries the mean reward of one episode of it as `baseline_reward`."""
    if n_samples < 1:
        raise ValueError(f"a group needs at least one episode, got n_samples={n_samples}")
    shared = GroupEngine(engine)
    episodes = [workflow.arun_episode(shared, episode_data(data, i)) for i in range(n_samples)]
    if baseline is not None:
        # greedy decoding draws no sample: the baseline episode takes no seed, as evaluation's episodes
        unseeded = {key: value for key, value in data.items() if key != "sampling_seed"}
        episodes.append(baseline.arun_episode(shared, {**unseeded, "sample_idx": n_samples}))
    tasks = [asyncio.ensure_future(episode) for episode in episodes]
    try:
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:  # one episode failed (or the group was cancelled): its siblings need not finish
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await shared.aclose()
    group = []
    for i, result in enumerate(results[:n_samples]):
        for t in episode_trajectories(result, workflow):
            t.group_id, t.sample_idx = data.get("prompt_id", t.group_id), i
            group.append(t)
    if baseline is not None:
        rewards = [t.reward for t in episode_trajectories(results[n_samples], baseline)]
        if not rewards:
            raise ValueError(f"the baseline episode of prompt {data.get('prompt_id')} made no trajectory")
        for t in group:
            t.baseline_reward = sum(rewards) / len(rewards)
    return group


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


async def play_group(workflow: Any, engine: Any, data: dict[str, Any], n_samples: int, baseline: Optional[Any] = None,
                     *, slot: int, policy: Any, recover: Optional[Any] = None) -> Any:
    """The group of prompt `data` (batch position `slot`) under the failure policy `policy` (failures.FailurePolicy):
    a `failures.GroupResult`. `recover`, where given, is awaited before an episode that failed at an inference server
    is played again (it brings a restarted server back to the expected weights).

    Interface frozen for #35; the retries and the mask/refill outcomes are filled in by the failure-policy work."""
    from areal_pipeline.rollout.failures import EpisodeFailure, EpisodesFailed, GroupResult

    try:
        trajectories = await run_group(workflow, engine, data, n_samples, baseline)
    except Exception as error:
        if policy.on_failure == "fail":
            raise EpisodesFailed(f"prompt {data.get('prompt_id')}: {type(error).__name__}: {error}") from error
        failure = EpisodeFailure(cause="agent", retryable=True, message=f"{type(error).__name__}: {error}")
        return GroupResult(slot, data.get("prompt_id"), [], failures=[failure], outcome="dropped")
    return GroupResult(slot, data.get("prompt_id"), trajectories)
