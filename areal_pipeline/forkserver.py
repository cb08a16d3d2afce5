"""Services forked from a process that has already imported what they need, instead of each importing it again.

A CPU inference server or a trainer started as `python -m ...` spends seconds importing torch and transformers'
Qwen2 modules before it loads a model; on a small machine, two of them plus the command's own imports and
Prefect's API server dominated the start-up of a default run. Python's forkserver start method (stdlib
`multiprocessing`) does that import once, in a server process; each service is then a fork of it, healthy a
fraction of a second after it is asked for (docs/prefect.md and `bench/startup.py` give the figures).
`areal-pipeline train` makes a fork of itself that server (`start_here`) once it has imported torch and
transformers' auto classes, which it needs too (the same in a sweep's run); the fork imports the services'
remaining modules while the command imports Prefect's, so on a small machine no import is done twice. Elsewhere
(a process with threads, tests that run flows in-process) the server is a new interpreter that imports the list
itself (`start_preloading`).

A forked service is the same program as the launched one: the module's `main(argv)`, in a session of its own,
its output in its log file, its environment the launcher's. A single-rank trainer is forked as the rank itself
(no torchrun agent: its store is a file, its gloo device on loopback). Several ranks, SGLang, and a service
restarted after the forkserver is gone still go through their command line. `AREAL_FORKSERVER=0` turns forking
off.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from multiprocessing import context as mp_context
from multiprocessing import forkserver as mp_forkserver
from multiprocessing import connection as mp_connection
from multiprocessing import popen_forkserver, resource_tracker, spawn, util
from typing import TYPE_CHECKING, Optional

from areal_pipeline.utils import PARENT_PID_ENV, environment

if TYPE_CHECKING:
    import psutil

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
            with environment(**started_with):
                mp_forkserver.ensure_running()
            _context = context
        return _context


def start_here() -> Optional[multiprocessing.context.BaseContext]:
    """Import what this process and its services both need (torch, transformers' auto classes: the command
    loads a tokenizer), then make a fork of this process the forkserver, which imports the rest of `PRELOAD` in
    the background: the services share this process's imports instead of a second interpreter importing them
    again (seconds of CPU that a small machine's command needs for its own start-up). Call it before torch is
    imported, before any thread starts and before the first torch operation (a fork of a process whose OpenMP
    pool has run can hang). Falls back to `start_preloading` where this process has other threads (a fork would
    hold their locks for ever) or another OpenMP wait policy."""
    global _context
    if enabled() and "torch" not in sys.modules:
        # read when torch is imported: idle threads must wait passively in the services (ServerProcess.start)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from areal_pipeline.model import preimport_tokenizer

    preimport_tokenizer()
    if not enabled():
        return None
    with _lock:
        if _context is not None:
            return _context
        fork_here = threading.active_count() == 1 and os.environ.get("OMP_WAIT_POLICY") == "PASSIVE"
        if fork_here:
            _fork_forkserver()
            _context = multiprocessing.get_context("forkserver")
    return _context if fork_here else start_preloading()


def _fork_forkserver() -> None:
    """`multiprocessing.forkserver.ForkServer.ensure_running` (CPython 3.9-3.13), except that the server is a fork
    of this process rather than a new interpreter that imports the preload list."""
    server = mp_forkserver._forkserver
    resource_tracker.ensure_running()
    with socket.socket(socket.AF_UNIX) as listener:
        address = mp_connection.arbitrary_address("AF_UNIX")
        listener.bind(address)
        if not util.is_abstract_socket_namespace(address):
            os.chmod(address, 0o600)
        listener.listen()
        # every client (this process and each service) holds the write end: EOF tells the server to end
        alive_r, alive_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.close(alive_w)
                _become_forkserver(listener.fileno(), alive_r)
            except SystemExit:
                pass
            except BaseException:
                code = 1
            finally:
                os._exit(code)  # never this command's exit handlers (Prefect's log drain, ...), in a copy of it
        os.close(alive_r)
    server._forkserver_address = address
    server._forkserver_alive_fd = alive_w
    server._forkserver_pid = pid


def new_process_stop_handlers() -> None:
    """A new interpreter's SIGINT/SIGTERM handlers, in a fork of a process that installed its own."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def close_descriptors(keep: set[int] = frozenset()) -> None:
    """Close every descriptor above 2 but `keep`: a fork holds none of its parent's pipes, sockets or files."""
    for fd in sorted(int(name) for name in os.listdir("/proc/self/fd") if name.isdigit()):
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


def _become_forkserver(listener_fd: int, alive_r: int) -> None:
    # not the command's stop handlers: a fresh interpreter's, which the forks get back from the server's loop
    new_process_stop_handlers()
    # only what the server needs stays open: no pipe or log file of the command's is held after it ends
    close_descriptors({listener_fd, alive_r, resource_tracker._resource_tracker._fd})
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    os.environ["SPT_NOENV"] = "1"
    from setproctitle import setproctitle

    # short: the title has the room of the command's own command line only; `processes_of` finds it by this
    setproctitle(_forkserver_title(os.getppid()))
    mp_forkserver.main(listener_fd, alive_r, preload=PRELOAD)  # a service forked meanwhile waits for it


def _forkserver_title(launcher_pid: int) -> str:
    return f"multiprocessing.forkserver of {launcher_pid}"


def processes_of(launcher_pid: int, forkserver: bool = True) -> list["psutil.Process"]:
    """The processes a command (`launcher_pid`) started and that are still there, as `psutil.Process`es: those
    whose environment names it (AREAL_PARENT_PID: launched services, the temporary API server, a spawned
    forkserver and its forks), and a forkserver forked from it (`start_here`) with every process forked from
    that (their environment is the command's own, which does not name it); the forkservers themselves only with
    `forkserver`. Found after the command is gone too (killed), which is what checks for leftovers need."""
    import psutil

    found: dict[int, psutil.Process] = {}
    title = _forkserver_title(launcher_pid)
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(PARENT_PID_ENV) == str(launcher_pid):
                found[proc.pid] = proc
            elif " ".join(proc.cmdline()).strip() == title:
                found[proc.pid] = proc
                found.update((child.pid, child) for child in proc.children(recursive=True))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    if not forkserver:
        found = {pid: proc for pid, proc in found.items() if not _is_forkserver(proc)}
    return list(found.values())


def _is_forkserver(proc) -> bool:
    import psutil

    try:
        return "multiprocessing.forkserver" in " ".join(proc.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


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


class _WorkerContext(mp_context.ForkServerContext):
    """The forkserver start method for a process pool's workers, without the parent's `__main__` either."""

    Process = _ServiceProcess


def worker_context() -> Optional[multiprocessing.context.BaseContext]:
    """A multiprocessing context whose processes are forks of the services' forkserver, or None where this
    process runs none (starting one for a pool alone would cost more than it saves). Such a process starts with
    the forkserver's /dev/null as its output: pass it `InheritedOutput()`, which it receives as an object whose
    `adopt()` makes this process's stdout and stderr its own."""
    if not enabled() or _context is None:
        return None
    return _WorkerContext()


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
