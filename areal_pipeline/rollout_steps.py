"""The rollout node: an iteration's episodes, played where they are missing and written as its rollout shards.

Every group is written to the iteration's episode journal (rollout/journal.py) as it ends, so that a killed command,
a retried node or a restarted asynchronous executor plays only the groups not yet on disk; when every batch position
has its group, they become the iteration's shards and the journal is removed. Episodes are seeded (seed, iteration,
prompt), so a group played again samples the same tokens: a resumed rollout's `content_sha256` is an uninterrupted
one's.

`RolloutSteps` is the part of `Pipeline` that does this (a mixin: it reads the pipeline's config, paths, services,
trainer lock and policy versions).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from typing import Any, Callable

from areal_pipeline.data.shards import ShardError, keep_if_intact, read_manifest, shards_intact
from areal_pipeline.rollout.executor import episode_seed, refill_prompt, resume_batch, select_batch
from areal_pipeline.rollout.failures import FailurePolicy, RolloutFailureRate
from areal_pipeline.rollout.journal import EpisodeJournal, episodes_digest, finish_rollout
from areal_pipeline.run_spec import build_workflow
from areal_pipeline.steps import timed
from areal_pipeline.utils import get_logger, raise_if_deadline_passed, run_async, time_left

logger = get_logger(__name__)


class RolloutSteps:
    @timed
    def rollout(self, k: int, progress: bool = False) -> dict[str, Any]:
        out = self.paths.rollout(k)
        refuse_to_replay_recorded_traffic(self.paths, k)
        # A corrupt earlier output is cleared and generated again: episodes are seeded, so the tokens are the same.
        if keep_if_intact(out):
            self.journal(k).remove()  # one left by a kill between the manifest and its removal
            self._journals.pop(k, None)
            return shards_record(out, read_manifest(out), cached=True)
        group_reward = self.start_group_reward()
        if self.cfg.rollout.max_head_offpolicyness > 0:
            served = self.sync_servers(k - 1 - self.cfg.rollout.max_head_offpolicyness, or_newer=True)["version"]
            return self._collect_async(k, served, group_reward)
        self.sync_servers(k - 1)
        workflow, baseline = self._workflow(), self._baseline_workflow()
        started = time.perf_counter()

        async def run():
            async with self._engine() as engine:
                return await resume_batch(
                    workflow, engine, dict(enumerate(self._episodes(k))), self.journal(k),
                    max_concurrent_rollouts=self.cfg.rollout.max_concurrent_rollouts,
                    n_samples=self.cfg.rollout.gconfig.n_samples, policy=FailurePolicy.of(self.cfg.rollout),
                    baseline=baseline, recover=self.recover_hook(k - 1), refill=self._refill(k), progress=progress,
                    group_reward=group_reward)
        return self._finish_rollout(k, run_async(run()), time.perf_counter() - started)

    def journal(self, k: int) -> EpisodeJournal:
        """Iteration k's episode journal: one object for the run's process, whose writer thread the node, its
        retries and the asynchronous executor share (and `close_journals` ends)."""
        if k not in self._journals:
            self._journals[k] = EpisodeJournal(self.paths.episodes(k), run_id=self.cfg.run_id, iteration=k,
                                               batch_size=self.cfg.rollout.batch_size, digest=self._episodes_digest,
                                               delay_s=self.cfg.rollout.journal_delay)
        return self._journals[k]

    def close_journals(self) -> None:
        """End the journals' writer threads, each after what it was given is on disk."""
        journals, self._journals = self._journals, {}
        for journal in journals.values():
            journal.close(raise_errors=False)

    @functools.cached_property
    def _episodes_digest(self) -> str:
        return episodes_digest(self.cfg)

    def start_group_reward(self) -> Any:
        """The run's group reward (`rollout.group_reward`, rewards/group.py), ready to score: a judge the run serves is
        started where it is not running (again at its address, where it died), and the reward is built on first use.
        The rollout calls it before it plays or judges a group; None without a group reward."""
        if not self.cfg.rollout.group_reward:
            return None
        judge_address = self.services.start_judge()
        if self._group_reward is None:
            from areal_pipeline.rewards.group import make_group_reward
            from areal_pipeline.rewards.local_judge import served_judge_config

            cfg = self.cfg if judge_address is None else served_judge_config(self.cfg, judge_address)
            self._group_reward = make_group_reward(self.cfg.rollout.group_reward, cfg)
        return self._group_reward

    def take_group_reward_usage(self) -> dict[str, float]:
        """What the group reward's calls cost since the last take (judge/calls, judge/cost_usd, ...), as metrics; {}
        where the rollout has built none. It starts nothing."""
        return self._group_reward.take_usage() if self._group_reward is not None else {}

    def _finish_rollout(self, k: int, groups: list, seconds: float) -> dict[str, Any]:
        # what the group reward's calls cost since the last rollout (asynchronous mode: the calls of the iterations
        # played ahead since, too)
        usage = self.take_group_reward_usage()
        manifest = finish_rollout(groups, self.paths.rollout(k), self.journal(k),
                                  policy=FailurePolicy.of(self.cfg.rollout), seconds=seconds,
                                  rows_per_shard=self.cfg.rollout.shard_rows, extra_manifest={"policy_version": k - 1},
                                  extra_stats=usage)
        self._journals.pop(k, None)  # removed with its writer
        return shards_record(self.paths.rollout(k), manifest, cached=False)

    def recover_hook(self, version: int, or_newer: bool = False) -> Callable[[], Any]:
        """The `recover` of `executor.play_batch`: restarts dead inference servers and brings them back to `version`
        (`PolicyVersions.recover_servers`, in a thread). The episodes that fail together (a server died under all of
        them) share one recovery: a call while one runs waits for that one."""
        running: list[asyncio.Future] = []

        async def recover() -> None:
            if not running or running[0].done():
                running[:] = [asyncio.ensure_future(asyncio.to_thread(self.recover_servers, version, or_newer))]
            await asyncio.shield(running[0])
        return recover

    def _refill(self, k: int) -> Callable[[int, int], dict[str, Any]]:
        """The j-th reserve prompt of batch position `slot` (rollout.on_failure=refill), seeded as a batch's."""
        return functools.partial(refill_prompt, self.records(self.cfg.dataset.train_split), self.cfg.seed, k,
                                 batch_size=self.cfg.rollout.batch_size)

    def _episodes(self, k: int) -> list[dict[str, Any]]:
        """Iteration k's episodes: its prompts (a pure function of k), each with its sampling seed."""
        return [{**r, "sampling_seed": episode_seed(self.cfg.seed, k, r["prompt_id"])}
                for r in select_batch(self.records(self.cfg.dataset.train_split), k - 1,
                                      self.cfg.rollout.batch_size, self.cfg.seed)]

    def _workflow(self):
        return build_workflow(self.spec, self.tokenizer, self.reward_pool, **self._tool_kwargs())

    def _baseline_workflow(self):
        """The workflow of the baseline episode the rollout adds per prompt, where `ppo.advantage` asks for one (the
        greedy completion ReMax subtracts): the run's workflow, decoding greedily; else None."""
        from areal_pipeline.training.advantage_registry import make_advantage

        if not make_advantage(self.cfg.ppo).greedy_baseline:
            return None
        greedy = dataclasses.replace(self.cfg.rollout.gconfig, n_samples=1, greedy=True)
        cfg = dataclasses.replace(self.cfg, rollout=dataclasses.replace(self.cfg.rollout, gconfig=greedy))
        return build_workflow(self.spec, self.tokenizer, self.reward_pool, cfg=cfg, **self._tool_kwargs())

    def _collect_async(self, k: int, served_version: int, group_reward: Any) -> dict[str, Any]:
        """Asynchronous mode: iteration k's groups from the background executor (started on first use, from this
        iteration on; it journals every group it plays), written as the iteration's shards."""
        from areal_pipeline.rollout.async_executor import AsyncRolloutExecutor

        eta = self.cfg.rollout.max_head_offpolicyness
        if self._async_rollout is None:
            self._async_rollout = AsyncRolloutExecutor(
                first_iteration=k, last_iteration=self.cfg.total_iterations, eta=eta, version=served_version,
                batch_for=self._episodes, workflow=self._workflow(), engine_factory=self._engine,
                max_concurrent_rollouts=self.cfg.rollout.max_concurrent_rollouts,
                n_samples=self.cfg.rollout.gconfig.n_samples, baseline=self._baseline_workflow(),
                policy=FailurePolicy.of(self.cfg.rollout), journal_for=self.journal,
                recover=self.recover_hook(k - 1 - eta, or_newer=True), refill_for=self._refill,
                group_reward=group_reward)
            self._async_rollout.start()
        started = time.perf_counter()
        try:
            groups = self._async_rollout.collect(k, timeout=time_left())
        except TimeoutError as error:
            raise_if_deadline_passed(error)
            raise
        except Exception:
            # The executor keeps iteration k's failure for good: drop it, so that this node's retry starts a
            # fresh one at iteration k. What it played of any iteration is in the journals, and is not played again.
            self._stop_async_rollout()
            raise
        try:
            return self._finish_rollout(k, groups, time.perf_counter() - started)
        except RolloutFailureRate:
            # The executor would hand the same failed groups to the retry: a fresh one plays (or judges) them again
            # from the journal, which keeps the rest.
            self._stop_async_rollout()
            raise

    def _stop_async_rollout(self) -> None:
        self._async_rollout.stop()
        self._async_rollout = None

    def _tool_kwargs(self) -> dict[str, Any]:
        tools = self.services.tool_addresses
        return {"tool_addresses": tools} if tools else {}


def shards_record(out, manifest: dict, cached: bool) -> dict[str, Any]:
    """A step's record of the shards it wrote (or found): where they are, how many rows, and their stats."""
    return {**manifest["stats"], "shards": str(out), "rows": manifest["num_rows"], "cached": cached}


def refuse_to_replay_recorded_traffic(paths, k: int) -> None:
    """A recurring firing's traffic episodes (recurring/traffic.py) are what users were served: no rollout can play
    them again, so a damaged copy is an error, not a rollout to redo from the data set's rows."""
    out = paths.rollout(k)
    if paths.traffic_mark(k).is_file() and not shards_intact(out):
        raise ShardError(f"{out}: the recorded traffic placed here by a recurring firing is damaged and cannot be "
                         "played again; the firing keeps its own copy (<line>/firings/<n>/traffic/): run the firing "
                         "again to place it anew")
