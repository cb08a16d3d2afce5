"""Asynchronous rollout (AReaL's idea: rollouts never wait for training), with bounded staleness.

A background thread runs its own event loop and keeps generating episodes, iteration after iteration. The
episodes of iteration k (the groups of the prompts `select_batch` gives it, as in synchronous mode) are admitted
only while

    k - 1 <= version + max_head_offpolicyness          (AReaL: floor((started - 1) / batch_size) <= version + eta)

where `version` is the policy version the servers serve, and at most `max_concurrent_rollouts` episodes
are in flight. So with eta = 1, iteration k + 1 is being generated while iteration k's update runs. A weight
update pauses the servers: in-flight generations come back with partial tokens and the client continues them
under the new weights, each token tagged with the version that produced it; the staleness of an iteration
(k - 1 minus its oldest token's version) never exceeds eta.

`collect(k)` waits for iteration k's groups (`failures.GroupResult`s, played under the run's failure policy by
`executor.resume_batch`, as in synchronous mode) and hands them over; the rollout node writes them as shards, and from
then on they are the iteration's inputs (a rerun trains on exactly them).

With `journal_for`, every group of every iteration is written to that iteration's episode journal as it ends
(rollout/journal.py), so the work done ahead survives a killed orchestrator and a stopped or failed executor: a new
executor resumes each iteration it admits from its journal as the synchronous rollout does (`resume_batch`), playing
only the missing groups. A group on disk with a token older than its iteration's bound (k - 1 - eta) is played again,
so the staleness bound holds across restarts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable, Optional

from areal_pipeline.rollout.executor import resume_batch
from areal_pipeline.rollout.failures import FailurePolicy, GroupResult
from areal_pipeline.utils import get_logger

logger = get_logger(__name__)


class AsyncRolloutExecutor:
    def __init__(self, *, first_iteration: int, last_iteration: int, eta: int, version: int,
                 batch_for: Callable[[int], list[dict[str, Any]]], workflow, engine_factory,
                 max_concurrent_rollouts: int, n_samples: int, baseline=None, policy: Optional[FailurePolicy] = None,
                 journal_for: Optional[Callable[[int], Any]] = None, recover=None,
                 refill_for: Optional[Callable[[int], Callable[[int, int], dict[str, Any]]]] = None,
                 group_reward: Any = None):
        """`n_samples` episodes a prompt, `baseline`, the failure `policy` and `recover` as `executor.play_batch`
        takes them, and `refill_for(k)` its `refill` for iteration k; `journal_for(k)`: iteration k's
        `journal.EpisodeJournal` (None: nothing is journaled); `group_reward` as `executor.play_batch` takes it."""
        self.first_iteration = first_iteration
        self.last_iteration = last_iteration
        self.eta = eta
        self.batch_for = batch_for
        self.workflow = workflow
        self.engine_factory = engine_factory
        self.max_concurrent_rollouts = max_concurrent_rollouts
        self.n_samples = n_samples
        self.baseline = baseline
        self.policy = policy or FailurePolicy()
        self.journal_for = journal_for
        self.recover = recover
        self.refill_for = refill_for
        self.group_reward = group_reward
        self._version = version
        self._loop = asyncio.new_event_loop()
        self._batches: dict[int, concurrent.futures.Future] = {
            k: concurrent.futures.Future() for k in range(first_iteration, last_iteration + 1)}
        self._thread = threading.Thread(target=self._run, name="async-rollout", daemon=True)
        self._version_changed: Optional[asyncio.Event] = None
        self._main: Optional[asyncio.Task] = None

    # ----- called from the orchestrating thread ------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def set_version(self, version: int) -> None:
        """The servers now serve `version`: iterations up to version + 1 + eta may start."""
        def bump():
            self._version = max(self._version, version)
            self._version_changed.set()
        try:
            self._loop.call_soon_threadsafe(bump)
        except RuntimeError:  # the loop is not running yet, or is done (every iteration produced)
            self._version = max(self._version, version)

    def collect(self, k: int, timeout: Optional[float] = None) -> list[GroupResult]:
        if k not in self._batches:
            raise ValueError(f"iteration {k} is outside this executor's range "
                             f"{self.first_iteration}..{self.last_iteration}, or older than one collected since")
        groups = self._batches[k].result(timeout)
        # The executor keeps what it delivered only until a later iteration is collected (a retried rollout
        # node may collect k again), not for the whole run.
        for old in [i for i in self._batches if i < k]:
            self._batches.pop(old, None)
        return groups

    def stop(self) -> None:
        if self._main is not None:
            try:
                self._loop.call_soon_threadsafe(self._main.cancel)
            except RuntimeError:  # the loop is already closed: nothing left to cancel
                pass
        self._thread.join(timeout=30)

    # ----- the background loop ---------------------------------------------------------------------
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._version_changed = asyncio.Event()
        self._main = self._loop.create_task(self._produce())
        try:
            self._loop.run_until_complete(self._main)
        except asyncio.CancelledError:
            pass
        finally:
            for fut in list(self._batches.values()):
                if not fut.done():
                    fut.set_exception(RuntimeError("the asynchronous rollout executor was stopped"))
            # episodes still in flight end here, cancelled, rather than being destroyed with the closed loop
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.run_until_complete(self._loop.shutdown_asyncgens())
            self._loop.close()

    async def _produce(self) -> None:
        in_flight = asyncio.Semaphore(max(1, self.max_concurrent_rollouts // max(1, self.n_samples)))
        iterations = []
        async with self.engine_factory() as engine:
            for k in range(self.first_iteration, self.last_iteration + 1):
                while k - 1 > self._version + self.eta:  # admission control: bounded staleness
                    self._version_changed.clear()
                    await self._version_changed.wait()
                logger.info("async rollout: admitting iteration %d at policy version %d (eta %d)",
                            k, self._version, self.eta)
                iterations.append(asyncio.create_task(self._iteration(k, engine, in_flight)))
            await asyncio.gather(*iterations)

    async def _iteration(self, k: int, engine, in_flight: asyncio.Semaphore) -> None:
        try:
            # The journal is loaded in this coroutine, not in a thread: the groups of iteration k must queue for
            # `in_flight` before those of any later iteration (a journal is empty but after a restart, when reading
            # it is all there is to do).
            groups = await resume_batch(
                self.workflow, engine, dict(enumerate(self.batch_for(k))),
                self.journal_for(k) if self.journal_for is not None else None, oldest_version=k - 1 - self.eta,
                gate=in_flight, max_concurrent_rollouts=self.max_concurrent_rollouts, n_samples=self.n_samples,
                policy=self.policy, baseline=self.baseline, recover=self.recover,
                refill=self.refill_for(k) if self.refill_for is not None else None, progress=False,
                group_reward=self.group_reward)
            self._batches[k].set_result(groups)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # surfaces in collect(k), i.e. in iteration k's rollout node
            logger.exception("async rollout of iteration %d failed", k)
            self._batches[k].set_exception(e)
