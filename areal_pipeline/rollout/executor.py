"""Run a batch of prompts' groups of episodes concurrently against the inference servers and write them as shards."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import random
from typing import Any, Callable, Optional

from tqdm.auto import tqdm

from areal_pipeline.data.trajectory import Trajectory
from areal_pipeline.rollout.group import play_group
from areal_pipeline.rollout.judging import judge_group
from areal_pipeline.utils import get_logger

logger = get_logger(__name__)


def episode_seed(seed: int, iteration: int, prompt_id: str) -> int:
    """The sampling seed of one episode: a rerun of the iteration samples the same tokens."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{iteration}/{prompt_id}".encode()).digest()[:4], "little") >> 1


def select_batch(records: list[dict[str, Any]], iteration: int, batch_size: int, seed: int) -> list[dict[str, Any]]:
    """The prompts of one iteration: epochs of seeded shuffles, consumed `batch_size` at a time.

    A pure function of (iteration, seed), so the data-loader position is the iteration number and a
    rerun of an iteration sees the same prompts.
    """
    if not records:
        raise ValueError("the dataset is empty")
    batch = []
    start = iteration * batch_size
    for position in range(start, start + batch_size):
        epoch, index = divmod(position, len(records))
        batch.append(records[_epoch_order(seed, epoch, len(records))[index]])
    return batch


@functools.lru_cache(maxsize=4)
def _epoch_order(seed: int, epoch: int, size: int) -> tuple[int, ...]:
    # a shuffle of a large data set costs milliseconds: once per epoch, not once per prompt
    order = list(range(size))
    random.Random(f"{seed}-epoch-{epoch}").shuffle(order)
    return tuple(order)


async def run_episodes(workflow, engine, records: list[dict[str, Any]], *, max_concurrent_rollouts: int,
                       n_samples: int = 1, baseline: Any = None, progress: bool = True) -> list[Trajectory]:
    """Each record's group of `n_samples` episodes (group.run_group; with `baseline`, the baseline workflow's episode
    beside them), with at most `max_concurrent_rollouts` episodes in flight, whole groups at a time; return the
    trajectories in record order, each group's in episode order.

    Strict: the first episode that fails fails it with its own error, no retries (`try-workflow` shows it so).
    Training and evaluation play their groups with `play_batch` and a failure policy."""
    groups = await play_batch(workflow, engine, dict(enumerate(records)), n_samples=n_samples, policy=None,
                              max_concurrent_rollouts=max_concurrent_rollouts, baseline=baseline, progress=progress)
    return [t for group in groups for t in group.trajectories]


async def play_batch(workflow, engine, slots: dict[int, dict[str, Any]], *, max_concurrent_rollouts: int,
                     n_samples: int, policy: Any, baseline: Any = None, recover: Any = None,
                     refill: Optional[Callable[[int, int], dict[str, Any]]] = None,
                     on_group: Optional[Callable[[Any], None]] = None, progress: bool = True,
                     group_reward: Any = None, played: Optional[dict[int, Any]] = None,
                     gate: Optional[asyncio.Semaphore] = None) -> list[Any]:
    """The groups of the prompts `slots` (batch position -> record) under the failure policy `policy`
    (group.play_group; None: strict, as `run_episodes`), at most `max_concurrent_rollouts` episodes in flight (or as
    many groups as `gate` lets through, where batches share one): their `failures.GroupResult`s in slot order.
    `refill(slot, j)` gives the j-th reserve prompt of a group that `rollout.on_failure=refill` replaces (a pure
    function, so a rerun refills with the same prompts; `refill_prompt` is one); `group_reward` scores each group
    played (`rollout.group_reward`, judging.judge_group); `played` (batch position -> a group whose episodes were
    played, awaiting its scores) are judged, not played again.

    `on_group(result)` is called on the event loop as each group ends (it must not block: the episode journal's
    writer queues the group for its thread), but for a group the judge dropped: the journal keeps it played and
    unjudged, for the next attempt to judge. The first error that fails a group (one that is no episode's fault,
    `rollout.on_failure=fail`) cancels the others and is raised."""
    gate = gate or asyncio.Semaphore(max(1, max_concurrent_rollouts // max(1, n_samples)))
    played = played or {}
    judge = None
    if group_reward is not None:
        judge = functools.partial(judge_group, group_reward, policy=policy, on_group=on_group)
    bar = tqdm(total=len(slots), desc="rollout", unit="group", disable=not progress, leave=False)

    async def one(slot, data):
        result = await play_group(workflow, engine, data, n_samples, baseline, slot=slot, policy=policy,
                                  recover=recover, refill=refill, judge=judge, gate=gate, played=played.get(slot))
        if on_group is not None and not result.judge_failed:
            on_group(result)
        bar.update(1)
        return result

    groups = [asyncio.ensure_future(one(slot, data)) for slot, data in sorted(slots.items())]
    try:
        return list(await asyncio.gather(*groups))
    finally:
        for group in groups:  # finished unless one failed: the others need not finish (the finished are journaled)
            group.cancel()
        await asyncio.gather(*groups, return_exceptions=True)
        bar.close()


async def resume_batch(workflow, engine, slots: dict[int, dict[str, Any]], journal: Any, *,
                       oldest_version: Optional[int] = None, **settings: Any) -> list[Any]:
    """An iteration's groups (`slots`: batch position -> seeded record), resumed from its episode journal
    (journal.EpisodeJournal; None: none kept): the groups on disk as they are, those of them awaiting the group
    reward's scores judged, not played again, and the rest played; each written to the journal as it ends. `settings`
    are `play_batch`'s; `oldest_version` as `EpisodeJournal.load` takes it. The one path of the synchronous rollout
    node and of the asynchronous executor's iterations (async_executor.py): both resume the same way."""
    loaded = journal.load(slots, oldest_version) if journal is not None else {}
    if loaded:
        logger.info("resuming iteration %d: %d/%d groups on disk", journal.iteration, len(loaded), len(slots))
    unjudged = {slot: group for slot, group in loaded.items() if not group.judged}
    if unjudged:
        logger.warning("iteration %d: %d group(s) on disk await the group reward's scores (it failed before): "
                       "judging them, not playing them again", journal.iteration, len(unjudged))
    todo = {slot: record for slot, record in slots.items() if slot not in loaded or slot in unjudged}
    played = []
    if todo:
        played = await play_batch(workflow, engine, todo, played=unjudged,
                                  on_group=journal.writer(slots) if journal is not None else None, **settings)
    done = [group for slot, group in loaded.items() if slot not in unjudged]
    return sorted([*done, *played], key=lambda group: group.slot)


def refill_prompt(records: list[dict[str, Any]], seed: int, iteration: int, slot: int, j: int,
                  batch_size: int) -> dict[str, Any]:
    """The j-th reserve prompt of batch position `slot` of iteration `iteration` (1-based, as `episode_seed`: its
    prompts are `select_batch(records, iteration - 1, ...)`): a record not in that batch, with its own sampling seed.
    A pure function, so a rerun refills with the same prompts; the reserves of distinct (slot, j) differ while the
    data set has prompts enough, taken from a shuffle of its own (seeded "{seed}-refill-{iteration}")."""
    if iteration < 1 or not 0 <= slot < batch_size or j < 0:
        raise ValueError(f"refill_prompt: iteration {iteration} (from 1), slot {slot} (0..{batch_size - 1}) and "
                         f"j {j} (from 0) out of range")
    taken = {r["prompt_id"] for r in select_batch(records, iteration - 1, batch_size, seed)}
    order = list(range(len(records)))
    random.Random(f"{seed}-refill-{iteration}").shuffle(order)
    reserves = [records[i] for i in order if records[i]["prompt_id"] not in taken]
    if not reserves:
        raise ValueError(f"rollout.on_failure=refill: iteration {iteration}'s batch holds every prompt of the data "
                         "set, none is left to refill a group with")
    record = reserves[(j * batch_size + slot) % len(reserves)]
    return {**record, "sampling_seed": episode_seed(seed, iteration, f"refill/{slot}/{j}/{record['prompt_id']}")}


def rollout_stats(trajectories: list[Trajectory], seconds: float, groups: Optional[list[Any]] = None
                  ) -> dict[str, float]:
    """The iteration's rollout metrics; with `groups` (play_batch's GroupResults) its failure metrics too
    (failures.failure_stats)."""
    from areal_pipeline.rollout.failures import failure_stats

    n = max(1, len(trajectories))
    rewards = [t.reward for t in trajectories]
    mean = sum(rewards) / n
    generated = sum(t.num_generated for t in trajectories)
    token_versions = [v for t in trajectories for v, m in zip(t.versions, t.loss_mask) if m]
    return {
        "min_token_version": min(token_versions, default=None),
        "max_token_version": max(token_versions, default=None),
        "num_trajectories": len(trajectories),
        "reward_mean": mean,
        "reward_std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
        "accuracy": sum(r > 0 for r in rewards) / n,
        "response_length": generated / n,
        "truncated_fraction": sum(t.stop_reason == "length" for t in trajectories) / n,
        "generated_tokens": generated,
        "rollout_seconds": seconds,
        "rollout_tokens_per_s": generated / seconds if seconds > 0 else 0.0,
        **baseline_stats(trajectories),
        **agent_stats(trajectories),
        **(failure_stats(groups) if groups is not None else {}),
    }


def baseline_stats(trajectories: list[Trajectory]) -> dict[str, float]:
    """The mean reward of the baseline episodes (ReMax's greedy completions), where the rollout ran them."""
    baselines = [t.baseline_reward for t in trajectories if t.baseline_reward is not None]
    return {"baseline_reward": sum(baselines) / len(baselines)} if baselines else {}


NOT_AGENT_METADATA = ("answer", "latency")  # the reference answer and the server's timing are no agent facts


def agent_stats(trajectories: list[Trajectory]) -> dict[str, float]:
    """Each numeric (or boolean) per-episode fact a workflow put in `metadata` (first_turn_correct, num_searches,
    ...), averaged over the trajectories that have it, as `agent/<key>`."""
    values: dict[str, list[float]] = {}
    for t in trajectories:
        for key, value in t.metadata.items():
            if isinstance(value, (bool, int, float)) and key not in NOT_AGENT_METADATA:
                values.setdefault(key, []).append(float(value))
    return {f"agent/{key}": sum(v) / len(v) for key, v in sorted(values.items())}
