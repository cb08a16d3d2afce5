"""Services forked from a process that has already imported what they need, instead of each importing it again.

A CPU inference server or a trainer started as `python -m ...` spends seconds importing torch and transformers
before it loads a model. Python's forkserver start method (stdlib `multiprocessing`) does that import once, in
a server process started early (`start`, told by its caller what to import: `multiprocessing`'s
`set_forkserver_preload`) that imports in the background while the command goes on with its own start-up; each
service is then a fork of it, healthy a fraction of a second after it is asked for.

A forked service is the same program as the launched one: the module's `main(argv)`, in a session of its own,
its output in its log file, its environment the launcher's. As every process of multiprocessing's, it first
imports the launching program's main module (under the name `__mp_main__`: a script's `if __name__ ==
"__main__":` block does not run again). A single-rank trainer is forked as the rank itself (no torchrun agent:
its store is a file, its gloo device on loopback). Several ranks, SGLang, and a service restarted after the
forkserver is gone still go through their command line. `AREAL_FORKSERVER=0` turns forking off.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from multiprocessing import forkserver as mp_forkserver
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from areal_pipeline.utils import PARENT_PID_ENV, environment

if TYPE_CHECKING:
    import psutil

_lock = threading.Lock()
_context: Optional[multiprocessing.context.BaseContext] = None


def enabled() -> bool:
    return os.environ.get("AREAL_FORKSERVER", "1") != "0" and sys.platform != "win32"


def start(preload: Sequence[str]) -> Optional[multiprocessing.context.BaseContext]:
    """Start the forkserver now, importing the modules `preload` names in the background; the context to fork
    services from, or None where forking is off. Idempotent and thread-safe: the first call's `preload` counts."""
    global _context
    if not enabled():
        return None
    with _lock:
        if _context is None:
            context = multiprocessing.get_context("forkserver")
            context.set_forkserver_preload([*preload, *_main_module()])
            # The forkserver's environment is this process's when it starts, and OpenMP reads its wait policy when
            # torch is imported, there: idle threads must wait passively (see ServerProcess.start).
            # Its services' launcher is this process: the forkserver's environment (which is what
            # /proc/<pid>/environ shows for every fork of it) names it, as a launched service's does.
            started_with = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY") or "PASSIVE",
                            PARENT_PID_ENV: str(os.getpid())}
            with environment(**started_with):
                _start_forkserver_process()
            _context = context
        return _context


def _main_module() -> list[str]:
    """The module this program runs as (`python -m prefect.engine`: a worker's flow run), which every fork
    imports again as `__mp_main__`: imported in the forkserver too, its own imports are done once."""
    name = getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None)
    return [name] if name and not name.endswith("__main__") else []


def _start_forkserver_process() -> None:
    """multiprocessing starts its forkserver when the first process is forked, and waits then until the preload is
    imported; `ensure_running` (in `multiprocessing.forkserver.__all__`) starts it now, without waiting for it."""
    mp_forkserver.ensure_running()


def processes_of(launcher_pid: int, forkserver: bool = True) -> list["psutil.Process"]:
    """The processes a command (`launcher_pid`) started and that are still there, as `psutil.Process`es: those
    whose environment names it (AREAL_PARENT_PID: launched services, the temporary API server, the forkserver and
    every fork of it); the forkserver itself (and multiprocessing's resource tracker, which the forkserver's start
    starts beside it, and which like it ends with the command) only with `forkserver`. Found after the command is gone too (killed),
    which is what checks for leftovers need."""
    import psutil

    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(PARENT_PID_ENV) == str(launcher_pid):
                found[proc.pid] = proc
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    if not forkserver:
        found = {pid: proc for pid, proc in found.items() if not _is_forkserver(proc)}
    return list(found.values())


def _is_forkserver(proc) -> bool:
    import psutil

    try:
        command = " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False
    return "multiprocessing.forkserver" in command or "multiprocessing.resource_tracker" in command


def _run_service(module: str, argv: list[str], log_path: str, env: dict[str, str]) -> None:
    """In the forked child: become what `python -m module *argv` would be, with `env`, output to `log_path`."""
    # Its command line too, as ps, psutil and the tools that look for a service by its command see it. Within
    # the room of the forkserver's own (long) command line only: the environment the process was started with
    # stays readable in /proc/<pid>/environ (AREAL_PARENT_PID there names the launching process).
    os.environ["SPT_NOENV"] = "1"
    from setproctitle import setproctitle

    setproctitle(" ".join([sys.executable, "-m", module, *argv]))
    os.setsid()  # a session of its own, as `start_new_session`: stopped as a group, never by the terminal's Ctrl-C
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [module, *argv]
    # tqdm's default lock (progress bars of model loading) is a named semaphore of the forkserver's resource
    # tracker, which a killed service never releases ("leaked semaphore" warnings at exit): one process, one lock
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
    importlib.import_module(module).main(argv)


class ForkedProcess:
    """A forked service behind the part of `subprocess.Popen`'s interface that `ServerProcess` uses."""

    def __init__(self, process: multiprocessing.process.BaseProcess):
        self._process = process
        self.pid: int = process.pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None and self._process.exitcode is not None:
            self.returncode = self._process.exitcode
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: Optional[float] = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self._process.name, timeout)
        return self.returncode


def worker_context() -> Optional[multiprocessing.context.BaseContext]:
    """A multiprocessing context whose processes are forks of the services' forkserver, or None where this
    process runs none (starting one for a pool alone would cost more than it saves). Such a process starts with
    the forkserver's /dev/null as its output: pass it `InheritedOutput()`, which it receives as an object whose
    `adopt()` makes this process's stdout and stderr its own."""
    return _context if enabled() else None


class InheritedOutput:
    """This process's stdout and stderr, for a process forked from the forkserver: pickled while that process
    starts, the descriptors themselves travel with it (multiprocessing's DupFd)."""

    def __reduce__(self):
        from multiprocessing import reduction

        return _InheritedOutputInChild, (reduction.DupFd(1), reduction.DupFd(2))


class _InheritedOutputInChild:
    def __init__(self, *duplicated):
        self.fds = tuple(d.detach() for d in duplicated)

    def adopt(self) -> None:
        for target, fd in zip((1, 2), self.fds):
            os.dup2(fd, target)
            os.close(fd)


def fork_service(module: str, argv: list[str], log_path: Path, env: dict[str, str]) -> Optional[ForkedProcess]:
    """`module.main(argv)` forked from the forkserver (started here if no one started it, preloading `module`),
    or None where forking is off or the forkserver is gone (the caller then launches the command line)."""
    context = start([module])
    if context is None:
        return None
    # daemon: should this process end without stopping it, multiprocessing's exit handler terminates it
    process = context.Process(target=_run_service, args=(module, list(argv), str(log_path), dict(env)),
                              name=module, daemon=True)
    try:
        process.start()
    except (OSError, EOFError, ConnectionError):  # the forkserver died (killed): the command line still works
        return None
    return ForkedProcess(process)
