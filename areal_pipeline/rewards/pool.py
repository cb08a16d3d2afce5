"""Run reward functions in worker processes, with a per-call timeout.

A reward function parses untrusted model output (sympy on adversarial LaTeX can hang), so it
runs out of process: pebble kills a worker whose call runs past the timeout and starts a new
one. A call that times out or raises scores 0.0 and the rollout goes on.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import multiprocessing
import signal
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Callable

import pebble

logger = logging.getLogger("areal_pipeline.rewards")

_MAX_ARGS_CHARS = 200


class RewardLoadError(RuntimeError):
    """A reward function named by reference could not be loaded: a configuration error, never a score of 0.0."""


_LOADED: dict[str, Callable[..., Any]] = {}  # reference -> function, per process


@dataclass(frozen=True)
class RewardReference:
    """A reward function named "module:attr" or "path/to/file.py:attr", loaded in the process that calls it.

    The pool's workers load it; the process that hands it to the pool never does, so the orchestrating process of
    a run does not import a reward module it never calls (math-verify's sympy: ~0.3 s of its start-up). A function
    from a file loads in a worker as well, which the function itself, pickled by its module's name, could not."""

    reference: str
    key: str = "reward_function"

    def load(self) -> Callable[..., Any]:
        fn = _LOADED.get(self.reference)
        if fn is None:
            from areal_pipeline.user_code import load_attr

            try:
                fn = load_attr(self.reference, self.key, "function")
            except Exception as error:
                raise RewardLoadError(f"{type(error).__name__}: {error}") from None
            if not callable(fn):
                raise RewardLoadError(f"{self.key}={self.reference!r} is not a function")
            _LOADED[self.reference] = fn
        return fn

    def __call__(self, *args: Any) -> Any:
        return self.load()(*args)

    def __str__(self) -> str:
        return self.reference


def _name(fn: Callable[..., Any]) -> str:
    return str(fn) if isinstance(fn, RewardReference) else f"{fn.__module__}.{getattr(fn, '__qualname__', fn)}"


def _load(reference: RewardReference) -> str:
    reference.load()
    return reference.reference


def _ignore_ctrl_c(output=None) -> None:
    """Workers share the terminal's process group: Ctrl-C would kill them mid-score with a traceback each. The
    parent process decides what an interrupt means and closes the pool. A worker forked from the services'
    forkserver takes the parent's stdout and stderr (`output`), as a spawned one inherits them."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if output is not None:
        output.adopt()


def _import(module: str) -> str:
    importlib.import_module(module)
    return module


def _score_each(fn: Callable[..., Any], calls: list[tuple]) -> list[Any]:
    """In a worker: `fn(*args)` for each call, as a float, or the error it raised as a string."""
    scores: list[Any] = []
    for args in calls:
        try:
            scores.append(float(fn(*args)))
        except RewardLoadError:
            raise
        except Exception as error:
            scores.append(repr(error))
    return scores


class RewardPoolError(RuntimeError):
    """The pool itself failed (its workers could not start or died): not a score, an error to surface."""

    def __init__(self, fn: Callable[..., Any], error: BaseException):
        super().__init__(
            f"reward workers for {getattr(fn, '__qualname__', fn)} died ({error!r}). Workers are spawned "
            "processes that import the parent's __main__ script: a script that starts work at import time "
            "needs an `if __name__ == '__main__':` guard."
        )


class RewardPool:
    """`fn` passed to `score`/`ascore` must be a picklable module-level function."""

    def __init__(self, max_workers: int = 1, timeout: float = 5.0):
        self.timeout = timeout
        self.max_workers = max_workers
        # Not forks of this process: it holds torch threads and an asyncio loop, which a forked child would
        # inherit in a broken state. Forks of the services' forkserver where this process runs one (it has this
        # package imported already), else new interpreters.
        from areal_pipeline import forkserver

        context = forkserver.worker_context()
        self._pool = pebble.ProcessPool(
            max_workers=max_workers, context=context or multiprocessing.get_context("spawn"),
            initializer=_ignore_ctrl_c, initargs=(forkserver.InheritedOutput(),) if context else (),
        )

    def warm_up(self, fn: Callable[..., Any]) -> list[Future]:
        """Start the workers and load `fn` (a RewardReference) or import its module in them now (in the
        background; a spawned worker importing math-verify takes seconds), so that the first scores do not wait for
        it. A reference that cannot load fails the first score that uses it, with RewardLoadError."""
        if isinstance(fn, RewardReference):
            return [self._pool.schedule(_load, args=(fn,)) for _ in range(self.max_workers)]
        return [self._pool.schedule(_import, args=(fn.__module__,)) for _ in range(self.max_workers)]

    def _submit(self, fn: Callable[..., Any], args: tuple) -> Future:
        return self._pool.schedule(fn, args=args, timeout=self.timeout)

    def _warn(self, fn: Callable[..., Any], args: tuple, error: Exception) -> None:
        shown = repr(args)
        if len(shown) > _MAX_ARGS_CHARS:
            shown = shown[:_MAX_ARGS_CHARS] + "..."
        if isinstance(error, TimeoutError):
            reason = f"timed out after {self.timeout}s"
        else:
            reason = repr(error)
        logger.warning("reward %s%s scored 0.0: %s", _name(fn), shown, reason)

    def score(self, fn: Callable[..., Any], *args: Any) -> float:
        """Blocking: `fn(*args)` as a float, or 0.0 if it times out or raises."""
        try:
            return float(self._submit(fn, args).result())
        except BrokenProcessPool as error:
            raise RewardPoolError(fn, error) from error
        except RewardLoadError:
            raise
        except Exception as error:
            self._warn(fn, args, error)
            return 0.0

    async def ascore(self, fn: Callable[..., Any], *args: Any) -> float:
        """`score` for asyncio; many calls may be awaited at once, they queue for the workers."""
        try:
            return float(await asyncio.wrap_future(self._submit(fn, args)))
        except BrokenProcessPool as error:
            raise RewardPoolError(fn, error) from error
        except RewardLoadError:
            raise
        except Exception as error:
            self._warn(fn, args, error)
            return 0.0

    async def ascore_many(self, fn: Callable[..., Any], calls: list[tuple]) -> list[float]:
        """`ascore` for each args tuple of `calls` (e.g. a GRPO group's completions), sent to one worker as
        one job: a group pays for one round trip to the pool instead of one per sample. The job's timeout is
        the per-call timeout times the number of calls; if it runs past it, each call is scored again on its
        own, so that only a call that hangs by itself scores 0.0."""
        if len(calls) <= 1:
            return [await self.ascore(fn, *args) for args in calls]
        try:
            future = self._pool.schedule(_score_each, args=(fn, list(calls)), timeout=self.timeout * len(calls))
            results = await asyncio.wrap_future(future)
        except BrokenProcessPool as error:
            raise RewardPoolError(fn, error) from error
        except RewardLoadError:
            raise
        except Exception as error:  # the job timed out (or could not be sent): score the calls one by one
            logger.warning("reward job of %d calls failed (%r); scoring them one by one", len(calls), error)
            return list(await asyncio.gather(*(self.ascore(fn, *args) for args in calls)))
        scores = []
        for args, result in zip(calls, results):
            if isinstance(result, str):
                self._warn(fn, args, RuntimeError(result))
                result = 0.0
            scores.append(result)
        return scores

    def close(self) -> None:
        """Waits for the calls already submitted (each bounded by the timeout), then stops."""
        self._pool.close()
        self._pool.join()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
