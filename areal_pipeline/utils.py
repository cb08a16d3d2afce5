"""Small shared helpers: atomic file writes, free ports, logging set-up, node deadlines."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import random
import shutil
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Coroutine, Iterator, Optional, TypeVar

T = TypeVar("T")


def _tmp_sibling(path: Path) -> Path:
    # A hidden temporary name in the same directory, so the final rename is atomic on one filesystem
    # and readers globbing for `*.parquet` / `manifest.json` never see a partial file.
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def atomic_write_bytes(path: Path, data: bytes) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def atomic_write_text(path: Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path next to `path`; rename it over `path` only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(path)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_directory(path: Path) -> Iterator[Path]:
    """Build a directory under a temporary name; replace `path` with it only if the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_sibling(path)
    tmp.mkdir()
    try:
        yield tmp
        if path.exists():
            old = _tmp_sibling(path)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def link_tree(source: Path, target: Path) -> bool:
    """`target` as a tree of hard links to `source`'s files; False where it had to copy (another file system).
    Hidden temporary files (an unfinished write) are left out."""
    copied = False

    def link(src: str, dst: str) -> None:
        nonlocal copied
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)
            copied = True

    shutil.copytree(source, target, copy_function=link, ignore=shutil.ignore_patterns(".*"), symlinks=False)
    return not copied


@contextlib.contextmanager
def environment(**variables: str) -> Iterator[None]:
    """`os.environ` with `variables` set for the block (what a process started in it inherits), as it was after."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


LOWEST_CHOSEN_PORT = 20000  # above the usual fixed services' ports (PostgreSQL 5432, Prefect 4200, 8000-8080)


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux; elsewhere the IANA range)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 49152, 65535


# A chosen port stays reserved for this long, for every process of this user on this machine: long enough for the
# service it was chosen for to start and bind it (or for a test to use it as an address where nothing listens)
PORT_RESERVATION_SECONDS = 120.0


def _port_reservations() -> Path:
    import tempfile

    directory = Path(tempfile.gettempdir()) / f"areal-pipeline-ports-{os.getuid()}"
    directory.mkdir(mode=0o700, exist_ok=True)
    return directory


def _reserve_port(port: int) -> bool:
    """Claim `port` for PORT_RESERVATION_SECONDS against every other caller of find_free_port on this machine (a
    file per port, checked and touched under one lock): two processes that each found the port free before either
    bound it would otherwise start two services on it."""
    import fcntl

    try:
        directory = _port_reservations()
        with open(directory / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            path = directory / str(port)
            try:
                if time.time() - path.stat().st_mtime < PORT_RESERVATION_SECONDS:
                    return False
            except FileNotFoundError:
                pass
            path.touch()  # an existing file's time too
            return True
    except OSError:
        return True  # no shared folder to coordinate through: the bind check alone


def find_free_port(host: str = "127.0.0.1") -> int:
    """A port free now on `host` for a service about to be started, chosen below the ephemeral range: a port the
    kernel hands out (bind to 0) lies in that range, where any process's outgoing connection may take it before the
    service binds it (a trainer died of EADDRINUSE so under parallel tests). Reserved for a while against every
    other caller on the machine (parallel test workers, two runs). Falls back to the kernel's choice."""
    low, _ = _ephemeral_ports()
    chooser = random.SystemRandom()
    for _ in range(64 if low > LOWEST_CHOSEN_PORT + 1000 else 0):
        port = chooser.randrange(LOWEST_CHOSEN_PORT, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        if _reserve_port(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def get_logger(name: str) -> logging.Logger:
    """Library loggers live under `areal_pipeline`, so one handler (Prefect's, or the CLI's) sees them all."""
    return logging.getLogger(name if name.startswith("areal_pipeline") else f"areal_pipeline.{name}")


PARENT_PID_ENV = "AREAL_PARENT_PID"


def exit_when_parent_dies(poll_seconds: float = 1.0) -> None:
    """End this process when its launcher ($AREAL_PARENT_PID) or its direct parent is gone.

    Services run in their own sessions so they can be stopped as a group; this keeps them from outliving an
    orchestrator that was killed outright (kill -9 skips its clean-up), and torchrun's ranks (which torchrun
    starts in sessions of their own) from outliving their torchrun agent."""

    watched = {os.getppid()}
    if os.environ.get(PARENT_PID_ENV):
        watched.add(int(os.environ[PARENT_PID_ENV]))

    def watch() -> None:
        import time

        while True:
            for pid in watched:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    logging.getLogger("areal_pipeline").warning("parent process %s is gone: exiting", pid)
                    os._exit(1)
                except PermissionError:  # alive, owned by someone else
                    pass
            if os.getppid() not in watched:  # reparented: the direct parent died between two polls
                os._exit(1)
            time.sleep(poll_seconds)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


# ----- deadlines -----------------------------------------------------------------------------------------
_DEADLINE: contextvars.ContextVar[Optional[tuple[float, str]]] = contextvars.ContextVar("areal_pipeline_deadline",
                                                                                         default=None)


class DeadlineExceeded(TimeoutError):
    """A step ran past the time limit given by `deadline`."""


@contextlib.contextmanager
def deadline(seconds: Optional[float], what: str) -> Iterator[None]:
    """Bound the blocking calls made inside the block (trainer commands, inference requests, waits on the
    rollout executor: each asks `time_left`) so that they end within `seconds` of entering it; past that they
    raise DeadlineExceeded. Unlike an exception injected into a thread, this interrupts a call that is blocked,
    and it costs no watcher thread."""
    if not seconds:
        yield
        return
    token = _DEADLINE.set((time.monotonic() + seconds, f"{what} ran past its {seconds:g} s limit"))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def _deadline_passed() -> Optional[str]:
    current = _DEADLINE.get()
    return current[1] if current is not None and time.monotonic() >= current[0] else None


def time_left(limit: Optional[float] = None) -> Optional[float]:
    """How long a blocking call may take: `limit` (None: unbounded), capped by the current deadline;
    DeadlineExceeded once that has passed."""
    current = _DEADLINE.get()
    if current is None:
        return limit
    left = current[0] - time.monotonic()
    if left <= 0:
        raise DeadlineExceeded(current[1])
    return left if limit is None else min(limit, left)


class PeerTimeout(TimeoutError):
    """A wait on another process (a rank, a server, a worker) ran past its own limit: the message names the peer."""

    def __init__(self, peer: str, what: str, seconds: float):
        super().__init__(f"{peer}: no {what} within {seconds:g} s")
        self.peer, self.what, self.seconds = peer, what, seconds


def raise_if_deadline_passed(error: BaseException) -> None:
    """Turn a timeout that the current deadline caused into DeadlineExceeded (other errors pass through)."""
    message = _deadline_passed()
    if message is not None:
        raise DeadlineExceeded(message) from error


def import_in_background(*modules: str) -> threading.Thread:
    """Import `modules` in a daemon thread: for what a process will import on its critical path later (its first
    request, its first shard), while it waits for something else now. A module missing is left to its user."""
    import importlib

    def load() -> None:
        for module in modules:
            with contextlib.suppress(ImportError):
                importlib.import_module(module)

    thread = threading.Thread(target=load, name="import-ahead", daemon=True)
    thread.start()
    return thread


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(coro)`, cancelled at the current deadline."""
    try:
        left = time_left()
    except DeadlineExceeded:
        coro.close()  # never started: close it, or Python warns that it was never awaited
        raise
    if left is None:
        return asyncio.run(coro)

    async def bounded() -> T:
        try:
            return await asyncio.wait_for(coro, left)
        except TimeoutError as error:
            raise_if_deadline_passed(error)
            raise

    return asyncio.run(bounded())
