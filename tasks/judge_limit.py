"""The judge's shared limit under Prefect: a global concurrency limit on the Prefect server (one per judge endpoint by
default, `judge.limit_name`), held around every judge call, so that every run, sweep and re-scoring using that server
keeps to `judge.max_concurrency` calls at once between them (ten runs do not exceed one API's rate). A judge built
inside `shared_judge_limit()` (a live run: tasks/runs.py; a re-scoring: flows/rescore.py) takes it as its limiter
(rewards/judge.py `limiter_installed`); outside, as without Prefect, it keeps a local semaphore.

The limit is created with `judge.max_concurrency` slots when missing; an existing one keeps its slots (a person may
have set them in the UI: `prefect gcl update <name> --limit N`).
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from typing import AsyncIterator, Iterator

from areal_pipeline.utils import get_logger

logger = get_logger(__name__)

_ensured: set[tuple[str, str]] = set()  # (API URL, limit name) known to exist
# one check at a time per event loop: a rollout's groups ask for their first slots together
_checking: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock]" = weakref.WeakKeyDictionary()


async def ensure_limit(name: str, slots: int) -> None:
    """The global concurrency limit `name` on this process's Prefect server, created with `slots` when missing."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL

    key = (str(PREFECT_API_URL.value()), name)
    if key in _ensured:
        return
    lock = _checking.setdefault(asyncio.get_running_loop(), asyncio.Lock())
    async with lock, get_client() as client:
        if key in _ensured:
            return
        try:
            await client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            try:
                await client.create_global_concurrency_limit(
                    GlobalConcurrencyLimitCreate(name=name, limit=slots, active=True))
                logger.info("created the Prefect global concurrency limit %r (%d slots) for the judge's calls",
                            name, slots)
            except Exception as error:  # another run created it meanwhile (a 409, or a 500 from SQLite's race)
                try:
                    await client.read_global_concurrency_limit_by_name(name)
                except ObjectNotFound:
                    raise error from None
    _ensured.add(key)


@contextlib.asynccontextmanager
async def prefect_judge_slot(name: str, slots: int, wait_s: float) -> AsyncIterator[None]:
    """One slot of the global concurrency limit `name` for one judge call (a LimiterFactory of rewards/judge.py);
    TimeoutError past `wait_s` seconds without one."""
    from prefect.concurrency.asyncio import concurrency

    await ensure_limit(name, slots)
    async with concurrency(name, occupy=1, timeout_seconds=wait_s, strict=True):
        yield


@contextlib.contextmanager
def shared_judge_limit() -> Iterator[None]:
    """Judges built in the block hold the Prefect limit around their calls; those built after it, no longer."""
    from areal_pipeline.rewards.judge import limiter_installed

    with limiter_installed(prefect_judge_slot):
        yield
