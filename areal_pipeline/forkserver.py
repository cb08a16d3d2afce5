"""Services forked from a process that has already imported what they need, instead of each importing it again.

A CPU inference server or a trainer started as `python -m ...` spends seconds importing torch and transformers'
Qwen2 modules before it loads a model; on a small machine, two of them plus the command's own imports and
Prefect's API server dominated the start-up of a default run. Python's forkserver start method (stdlib
`multiprocessing`) does that import once, in a server process started as soon as a command knows it will need
services (`start_preloading`), while the command goes on with its own set-up; each service is then a fork of it,
healthy a fraction of a second after it is asked for (README, "Start-up", and `bench/startup.py` give the figures).

A forked service is the same program as the launched one: the module's `main(argv)`, in a session of its own,
its output in its log file, its environment the launcher's. A single-rank trainer is forked as the rank itself
(no torchrun agent: its store is a file, its gloo device on loopback). Several ranks, SGLang, and a service
restarted after the forkserver is gone still go through their command line. `AREAL_FORKSERVER=0` turns forking
off.
"""

from __future__ import annotations

import importlib
import io
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from multiprocessing import context as mp_context
from multiprocessing import forkserver as mp_forkserver
from multiprocessing import popen_forkserver, spawn, util
from typing import Optional

from areal_pipeline.utils import PARENT_PID_ENV

# What the services import before their first line of work (the model class is resolved by name at load time,
# so a model of another architecture imports its own modules in the service, as it would anyway).
PRELOAD = [
    "areal_pipeline.inference.server",
    "areal_pipeline.training.trainer_server",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen2.tokenization_qwen2",
    "transformers.tokenization_utils_fast",
]

_lock = threading.Lock()
_context: Optional[multiprocessing.context.BaseContext] = None


def enabled() -> bool:
    return os.environ.get("AREAL_FORKSERVER", "1") != "0" and sys.platform != "win32"


def start_preloading() -> Optional[multiprocessing.context.BaseContext]:
    """Start the forkserver now (it imports `PRELOAD` in the background); the context to fork services from, or
    None where forking is off. Idempotent and thread-safe."""
    global _context
    if not enabled():
        return None
    with _lock:
        if _context is None:
            context = multiprocessing.get_context("forkserver")
            multiprocessing.set_forkserver_preload(PRELOAD)
            # The forkserver's environment is this process's when it starts, and OpenMP reads its wait policy when
            # torch is imported, there: idle threads must wait passively (see ServerProcess.start).
            # Its services' launcher is this process: the forkserver's environment (which is what
            # /proc/<pid>/environ shows for every fork of it) names it, as a launched service's does.
            started_with = {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY") or "PASSIVE",
                            PARENT_PID_ENV: str(os.getpid())}
            before = {name: os.environ.get(name) for name in started_with}
            os.environ.update(started_with)
            try:
                mp_forkserver.ensure_running()
            finally:
                for name, value in before.items():
                    if value is None:
                        os.environ.pop(name, None)
                    else:
                        os.environ[name] = value
            _context = context
        return _context


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


class _PopenWithoutMain(popen_forkserver.Popen):
    """multiprocessing's forkserver launch, except that the child does not import the parent's `__main__`.

    multiprocessing prepares every child by running the parent's main script (or module) again: for a user's
    script without an `if __name__ == "__main__":` guard that would start its whole run again inside a service,
    and even a guarded one costs its imports. A service needs nothing from it, so its preparation data leaves the
    main module out; the rest is `popen_forkserver.Popen._launch` (CPython 3.9-3.13) as it is."""

    def _launch(self, process_obj):
        prep_data = spawn.get_preparation_data(process_obj._name)
        for key in ("init_main_from_path", "init_main_from_name"):
            prep_data.pop(key, None)
        buf = io.BytesIO()
        mp_context.set_spawning_popen(self)
        try:
            mp_context.reduction.dump(prep_data, buf)
            mp_context.reduction.dump(process_obj, buf)
        finally:
            mp_context.set_spawning_popen(None)
        self.sentinel, w = mp_forkserver.connect_to_new_process(self._fds)
        parent_w = os.dup(w)  # the child's sentinel of this process
        self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = mp_forkserver.read_signed(self.sentinel)


class _ServiceProcess(mp_context.ForkServerProcess):
    @staticmethod
    def _Popen(process_obj):
        return _PopenWithoutMain(process_obj)


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


def fork_service(module: str, argv: list[str], log_path: Path, env: dict[str, str]) -> Optional[ForkedProcess]:
    """`module.main(argv)` forked from the forkserver, or None where forking is off or the forkserver is gone
    (the caller then launches the command line)."""
    context = start_preloading()
    if context is None:
        return None
    # daemon: should this process end without stopping it, multiprocessing's exit handler terminates it
    process = _ServiceProcess(target=_run_service, args=(module, list(argv), str(log_path), dict(env)),
                              name=module, daemon=True)
    try:
        process.start()
    except (OSError, EOFError, ConnectionError):  # the forkserver died (killed): the command line still works
        return None
    return ForkedProcess(process)
