"""Run reward functions in worker processes, with a per-call timeout.

A reward function parses untrusted model output (sympy on adversarial LaTeX can hang), so it
runs out of process: pebble kills a worker whose call runs past the timeout and starts a new
one. A score is never made up: a call that runs past the timeout raises RewardTimeout, a worker
that died under a call (killed, out of memory) RewardCrash, and a reward function that raised on
the answer RewardError (the user's reward code: it raises again on the same answer). The rollout
decides what an episode that failed so becomes (rollout/failures.py, `rollout.on_failure`): it
plays it again after a timeout or a crash, never after a RewardError.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import logging
import multiprocessing
import signal
import threading
from concurrent.futures import Future, InvalidStateError
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pebble
from pebble import ProcessExpired

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
        self.peer = f"reward worker of {_name(fn)}"


class RewardCrash(RewardPoolError):
    """The worker scoring a call died under it (killed, out of memory; pebble's ProcessExpired, or a pool whose
    workers broke): another attempt runs on a fresh worker."""

    def __init__(self, fn: Callable[..., Any], error: BaseException):
        # a worker that was running died: RewardPoolError's start-up advice does not apply
        pid = error.pid if isinstance(error, ProcessExpired) else None
        self.peer = f"reward worker pid {pid}" if pid is not None else f"reward worker of {_name(fn)}"
        RuntimeError.__init__(self, f"{self.peer} died scoring {_name(fn)} ({error!r})")


class RewardTimeout(TimeoutError):
    """A reward call ran past the pool's timeout (its worker was killed)."""

    def __init__(self, fn: Callable[..., Any], args: tuple, timeout: float):
        super().__init__(f"reward {_name(fn)}{_shown(args)} ran past {timeout:g} s")
        self.peer = f"reward {_name(fn)}"


class RewardError(RuntimeError):
    """The reward function raised on an answer: the user's reward code, which raises again on the same answer."""

    def __init__(self, fn: Callable[..., Any], args: tuple, error: Any):
        super().__init__(f"reward {_name(fn)}{_shown(args)} raised {error}")
        self.peer = f"reward {_name(fn)}"


def _shown(args: tuple) -> str:
    shown = repr(args)
    return shown[:_MAX_ARGS_CHARS] + "..." if len(shown) > _MAX_ARGS_CHARS else shown


def _resource_tracker_running() -> bool:
    """Whether this process's resource tracker (a child running `multiprocessing.resource_tracker`) is alive."""
    import psutil

    for child in psutil.Process().children():
        try:
            if ("multiprocessing.resource_tracker" in " ".join(child.cmdline())
                    and child.status() != psutil.STATUS_ZOMBIE):
                return True
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            pass
    return False


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
        self._new_pool = functools.partial(
            pebble.ProcessPool, max_workers=max_workers, context=context or multiprocessing.get_context("spawn"),
            initializer=_ignore_ctrl_c, initargs=(forkserver.InheritedOutput(),) if context else ())
        self._pool = self._new_pool()
        self._closed = False
        self._pending: set[Future] = set()  # calls not answered yet: failed, not left waiting, when the pool stops

    def warm_up(self, fn: Callable[..., Any]) -> list[Future]:
        """Start the workers and load `fn` (a RewardReference) or import its module in them now (in the
        background; a spawned worker importing math-verify takes seconds), so that the first scores do not wait for
        it. A reference that cannot load fails the first score that uses it, with RewardLoadError."""
        if isinstance(fn, RewardReference):
            return [self._schedule(_load, (fn,), None) for _ in range(self.max_workers)]
        return [self._schedule(_import, (fn.__module__,), None) for _ in range(self.max_workers)]

    def _schedule(self, fn: Callable[..., Any], args: tuple, timeout: Optional[float]) -> Future:
        try:
            return self._pool.schedule(fn, args=args, timeout=timeout)
        except RuntimeError as error:
            # pebble's pool is broken for good once one of its manager threads died (a worker killed at the wrong
            # moment can do it): every later call would fail the same way. A new pool takes its place.
            if self._closed:
                raise
            logger.warning("the reward pool broke (%s): starting a new one", error)
        except BrokenPipeError as error:
            # The pool's first call starts it, and its locks are registered with multiprocessing's resource tracker:
            # a tracker that ended between the standard library's check that it runs and the registration fails
            # the start so. A new pool's start launches the tracker again; one still running is another fault.
            if self._closed or _resource_tracker_running():
                raise
            logger.warning("the reward pool could not start: multiprocessing's resource tracker is gone (%s); "
                           "starting a new pool, which starts a new tracker", error)
        broken, self._pool = self._pool, self._new_pool()
        threading.Thread(target=broken.stop, name="stop-broken-reward-pool", daemon=True).start()
        return self._pool.schedule(fn, args=args, timeout=timeout)

    def _submit(self, fn: Callable[..., Any], args: tuple) -> Future:
        future = self._schedule(fn, args, self.timeout)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        return future

    def _failure(self, fn: Callable[..., Any], args: tuple, error: BaseException) -> Exception:
        """The error a failed call raises (RewardLoadError and cancellation are re-raised as they are)."""
        if isinstance(error, (RewardLoadError, asyncio.CancelledError)) or not isinstance(error, Exception):
            raise error
        if isinstance(error, (ProcessExpired, BrokenProcessPool)):
            return RewardCrash(fn, error)
        if isinstance(error, TimeoutError):  # pebble's: the call ran past the timeout and its worker was killed
            return RewardTimeout(fn, args, self.timeout)
        return RewardError(fn, args, repr(error))

    def score(self, fn: Callable[..., Any], *args: Any) -> float:
        """Blocking: `fn(*args)` as a float; RewardTimeout, RewardCrash or RewardError (module doc) when it fails."""
        try:
            result = self._submit(fn, args).result()
        except BaseException as error:
            raise self._failure(fn, args, error) from error
        return self._float(fn, args, result)

    async def ascore(self, fn: Callable[..., Any], *args: Any) -> float:
        """`score` for asyncio; many calls may be awaited at once, they queue for the workers."""
        try:
            result = await asyncio.wrap_future(self._submit(fn, args))
        except BaseException as error:
            raise self._failure(fn, args, error) from error
        return self._float(fn, args, result)

    @staticmethod
    def _float(fn: Callable[..., Any], args: tuple, result: Any) -> float:
        try:
            return float(result)
        except (TypeError, ValueError) as error:
            raise RewardError(fn, args, f"a score that is no number: {result!r}") from error

    async def ascore_many(self, fn: Callable[..., Any], calls: list[tuple]) -> list[float]:
        """`ascore` for each args tuple of `calls` (e.g. a GRPO group's completions), sent to one worker as
        one job: a group pays for one round trip to the pool instead of one per sample. The job's timeout is
        the per-call timeout times the number of calls; if it runs past it, each call is scored again on its
        own, so that the RewardTimeout names the call that hangs by itself."""
        if len(calls) <= 1:
            return [await self.ascore(fn, *args) for args in calls]
        try:
            future = self._schedule(_score_each, (fn, list(calls)), self.timeout * len(calls))
            results = await asyncio.wrap_future(future)
        except BaseException as error:
            failure = self._failure(fn, calls[0], error)
            if not isinstance(failure, RewardTimeout):
                raise failure from error
            logger.warning("reward job of %d calls ran past %g s; scoring them one by one", len(calls),
                           self.timeout * len(calls))
            return list(await asyncio.gather(*(self.ascore(fn, *args) for args in calls)))
        for args, result in zip(calls, results):
            if isinstance(result, str):
                raise RewardError(fn, args, result)
        return [self._float(fn, args, result) for args, result in zip(calls, results)]

    def close(self, timeout: float = 30.0) -> None:
        """Waits up to `timeout` seconds for the calls already submitted (each bounded by the pool's timeout), then
        stops the workers, killing those still busy."""
        self._closed = True
        self._pool.close()
        try:
            self._pool.join(timeout)
        except TimeoutError:
            logger.warning("reward calls still running after %g s: stopping the reward workers", timeout)
            self._pool.stop()
            self._pool.join()
        for future in list(self._pending):  # whoever waits on a call the stopped pool never answered
            try:
                future.set_exception(RuntimeError("the reward pool was closed before the call ended"))
            except InvalidStateError:  # answered meanwhile
                pass

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
