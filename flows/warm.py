"""The warm launcher: a process that has already imported what a run needs, so that a run starts as a fork of it.

Most of a run's start-up on a small machine is imports: torch, transformers' tokenizer and Qwen2 modules, Prefect
and its API server (docs/prefect.md; `bench/startup.py`). A fresh interpreter pays them on every command.
`areal-pipeline warm start` starts a launcher that imports them once and then waits on a socket; while it runs,
`areal-pipeline train`, `evaluate` and `sweep` (and each run of a sweep) send it their command line, working
directory, environment and terminal (the file descriptors themselves), and the launcher forks a process that runs
the command as the command would have: its output on the user's terminal, Ctrl-C and SIGTERM forwarded to it by
the command, its exit status the command's. Its services are forks of it in turn, with nothing left to import; so is
the Prefect API a run without one starts (the launcher keeps one for runs whose Prefect settings are its own).
Like Gradle's daemon, it is a cache: whenever it cannot run a command exactly as a new interpreter would, the
command starts cold and says why, so the result never depends on it:

- a file it imported has changed since (an upgrade, an edited module of this project): it restarts itself,
- the command's interpreter, or where its Python path finds this project's packages, is not the launcher's,
- an environment variable read while importing (OpenMP, MKL, PyTorch, Hugging Face, Python's own) differs.

Prefect's settings are read again from the command's environment in the fork (`refresh_global_settings_context`).
The socket is the user's own (mode 0600; a connection from another user is refused) at `$AREAL_WARM_SOCKET`, else
`$TMPDIR/areal-pipeline-warm-<uid>-<hash of the environment and the checkout>.sock`. It ends after `--idle-minutes`
without a run, on `areal-pipeline warm stop`, or on SIGTERM.

`AREAL_WARM` (`warm_mode`): `auto` (the default) uses a launcher where one runs and, like Gradle's daemon, starts one
in the background after a cold command that ran to its end (not under CI), so that the next command starts warm;
`1` uses one that you start; `0` ignores it.

    areal-pipeline warm start [--idle-minutes 240] [--preload MODULE ...] | stop | status
    python -m flows.warm serve --socket PATH [--idle-minutes N] [--preload MODULE ...]   (what `warm start` runs)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import struct
import sys
from pathlib import Path
from typing import Optional

SOCKET_ENV = "AREAL_WARM_SOCKET"
MODE_ENV = "AREAL_WARM"
MODES = {"auto": "the default: use a warm launcher, and start one after a cold command",
         "1": "use a warm launcher that you start", "0": "no warm launcher"}
AUTO_IDLE_MINUTES = 60.0  # a launcher nobody asked for by name ends sooner than `warm start`'s
# what a fork may run: the command line (the commands that ask: areal_pipeline.cli.WARM_COMMANDS), or one run of a
# sweep (`python -m flows.sweep --child`)
ENTRIES = {"cli": "areal_pipeline.cli:main", "sweep-run": "flows.sweep:_child",
           "mp-spawn": "flows.warm:_spawned_child",  # a process that multiprocessing spawns (a deployment run)
           "prefect-engine": "flows.warm:_prefect_engine"}  # a flow run a Prefect worker starts: `areal-pipeline engine`
# read while the preloaded modules import: a command whose value differs would not get what it asked for
IMPORT_TIME_ENV_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "OPENBLAS_", "PYTORCH_", "TORCH_", "HF_", "HUGGINGFACE",
                            "TRANSFORMERS_", "TOKENIZERS_", "PYTHON", "LD_", "SAFETENSORS_", "MPL",
                            "LANG", "LC_", "TZ")  # the last three: the standard streams' encoding, the local time
PROJECT_PACKAGES = ("areal_pipeline", "flows", "tasks")
MAX_FDS = 8  # a request's descriptors: the terminal's three, a spawned child's two pipes


def socket_path() -> Path:
    configured = os.environ.get(SOCKET_ENV)
    if configured:
        return Path(configured)
    return Path(os.environ.get("TMPDIR") or "/tmp") / f"areal-pipeline-warm-{os.getuid()}-{_installation()}.sock"


def _installation() -> str:
    """This environment's and this project's copy, in a few characters: two virtual environments or checkouts
    of one user each have a launcher (a command of one would start cold with the other's, for good)."""
    import hashlib

    where = f"{os.path.dirname(os.path.abspath(sys.executable))}\0{Path(__file__).resolve().parents[1]}"
    return hashlib.sha256(where.encode()).hexdigest()[:8]


def warm_mode() -> str:
    value = os.environ.get(MODE_ENV, "").strip().lower() or "auto"
    if value not in MODES:
        raise SystemExit(f"{MODE_ENV}={value!r} is not one of: "
                         + "; ".join(f"{mode} ({meaning})" for mode, meaning in MODES.items()))
    return value


def _lock_path(path: Path) -> Path:
    return path.with_name(path.name + ".lock")


def _hold_launcher_lock(path: Path) -> int:
    """The lock a launcher holds from before its imports to its end, so that a second one (started by another
    command meanwhile) ends at once instead of importing for seconds and then finding the socket taken."""
    import fcntl

    fd = os.open(_lock_path(path), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SystemExit(f"a warm launcher is already starting or running on {path}") from None
    return fd


def _launcher_there(path: Path) -> bool:
    """Whether a launcher holds `path`'s lock: answering, or still importing."""
    import fcntl

    try:
        fd = os.open(_lock_path(path), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


# ----- wire format: one length-prefixed JSON request (the terminal's descriptors travel with its first bytes),
# then JSON lines from the launcher ---------------------------------------------------------------------------
def _send_request(sock: socket.socket, request: dict, fds: tuple[int, ...] = ()) -> None:
    body = json.dumps(request).encode()
    head = struct.pack("!I", len(body))
    if fds:
        socket.send_fds(sock, [head], list(fds))
    else:
        sock.sendall(head)
    sock.sendall(body)


def _read_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the peer closed the connection mid-message")
        data += chunk
    return data


def _receive_request(sock: socket.socket) -> tuple[dict, list[int]]:
    head, fds, _, _ = socket.recv_fds(sock, 4, MAX_FDS)
    if len(head) < 4:
        head += _read_exactly(sock, 4 - len(head))
    (length,) = struct.unpack("!I", head)
    return json.loads(_read_exactly(sock, length)), fds


def _ask(request: dict, timeout: float = 10.0) -> Optional[dict]:
    """One request and its one-line reply, or None where no launcher answers."""
    try:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(timeout)
            sock.connect(str(socket_path()))
            _send_request(sock, request)
            line = sock.makefile("rb").readline()
    except OSError:
        return None
    return json.loads(line) if line else None


# ----- the command's side ---------------------------------------------------------------------------------
def _project_packages() -> dict[str, Optional[str]]:
    from importlib.util import find_spec

    found = {}
    for name in PROJECT_PACKAGES:
        try:
            spec = find_spec(name)
        except (ImportError, ValueError):
            spec = None
        found[name] = spec.origin if spec is not None else None
    return found


def _process_settings() -> dict:
    """What a process inherits besides its environment and a fork would not: limits, priority, CPUs."""
    import resource

    limits = {name: list(resource.getrlimit(getattr(resource, name)))
              for name in ("RLIMIT_NOFILE", "RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_CORE", "RLIMIT_CPU", "RLIMIT_NPROC",
                           "RLIMIT_STACK")
              if hasattr(resource, name)}
    return {"limits": limits, "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}


def run_warm(argv: list[str], entry: str = "cli", fds: tuple[int, ...] = (0, 1, 2)) -> Optional[int]:
    """Run `areal-pipeline *argv` (or another of `ENTRIES`) as a fork of the warm launcher and return its exit
    status, or None where no launcher runs or it cannot run this command as a new interpreter would (the command
    then runs here). The fork has `fds` under the same numbers (the terminal's, a spawned child's pipes)."""
    if warm_mode() == "0":
        return None
    path = socket_path()
    if not path.exists():
        return None
    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.settimeout(30.0)  # it answers after a look at its files' modification times: milliseconds
        sock.connect(str(path))
        umask = os.umask(0)
        os.umask(umask)
        _send_request(sock, {"op": "run", "entry": entry, "argv": [sys.argv[0], *argv], "cwd": os.getcwd(),
                             "env": dict(os.environ),
                             "path": sys.path, "executable": sys.executable, "umask": umask,
                             "process": _process_settings(),
                             "packages": _project_packages(), "fd_targets": list(fds)}, fds=fds)
        replies = sock.makefile("rb")
        reply = json.loads(replies.readline() or b"{}")
    except (OSError, ValueError):
        sock.close()
        return None
    if "pid" not in reply:
        print(f"areal-pipeline: started cold: {reply.get('cold', 'the warm launcher did not answer')}",
              file=sys.stderr)
        sock.close()
        return None
    pid = reply["pid"]

    def forward(signum, frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, forward)
    sock.settimeout(None)
    while True:
        try:
            line = replies.readline()
        except InterruptedError:
            continue
        if not line:  # the launcher was killed: the run goes on, and this command lasts as long as it does
            print(f"areal-pipeline: the warm launcher ended while process {pid} ran this command; its exit status "
                  f"is lost: waiting for it to end", file=sys.stderr)
            _wait_until_gone(pid)
            return 1
        message = json.loads(line)
        if "exit" in message:
            return int(message["exit"])


# what multiprocessing's spawn start method runs: EXE [interpreter flags] -c 'PROGRAM' [--multiprocessing-fork]
_SPAWN_MAIN = "from multiprocessing.spawn import spawn_main; spawn_main("


def _spawn_main_arguments(argv: list[str]) -> Optional[dict[str, int]]:
    """`spawn_main`'s keyword arguments where `argv` is a spawned child's command line, else None."""
    if len(argv) < 4 or argv[-1] != "--multiprocessing-fork" or argv[-3] != "-c":
        return None
    program = argv[-2]
    if not (program.startswith(_SPAWN_MAIN) and program.endswith(")")):
        return None
    arguments = {}
    for part in program[len(_SPAWN_MAIN):-1].split(","):
        key, _, value = part.strip().partition("=")
        if key not in ("tracker_fd", "pipe_handle") or not value.isdigit():
            return None
        arguments[key] = int(value)
    return arguments if "pipe_handle" in arguments else None


def use_for_spawned_processes() -> bool:
    """Have multiprocessing's spawn start method (how Prefect's runner starts each deployment run) start this
    project's command instead of the interpreter: it asks the warm launcher to run the child as a fork of it
    (nothing left to import) and is the interpreter itself, with the same arguments, where none can. Not with
    AREAL_WARM=0. Whether it does."""
    import multiprocessing
    from multiprocessing import resource_tracker

    script = Path(sys.executable).with_name("areal-pipeline")
    if warm_mode() == "0" or not script.is_file():
        return False
    resource_tracker.ensure_running()  # multiprocessing's own helper, started by the interpreter itself
    multiprocessing.set_executable(str(script))
    return True


def run_as_interpreter(argv: list[str]) -> None:
    """`areal-pipeline [flags] -c PROGRAM ...`, as multiprocessing starts its executable (`use_for_spawned_
    processes`): a spawned child as a fork of the warm launcher where one can run it; else (and any other
    program) the interpreter with these arguments. Does not return."""
    arguments = _spawn_main_arguments(argv)
    if arguments is not None:
        fds = (0, 1, 2, *(arguments[key] for key in ("tracker_fd", "pipe_handle") if key in arguments))
        code = run_warm(argv[1:], entry="mp-spawn", fds=fds)
        if code is not None:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.execv(sys.executable, [sys.executable, *argv[1:]])


def _spawned_child() -> None:
    """In the fork: what `python -c 'from multiprocessing.spawn import spawn_main; spawn_main(...)'` runs."""
    from multiprocessing import spawn

    arguments = _spawn_main_arguments(sys.argv)
    sys.argv = ["-c", "--multiprocessing-fork"]  # a new interpreter's, which spawn_main checks
    redo_prefect_logging()  # as its import of Prefect (the spawned function's module needs it) would have
    from areal_pipeline import forkserver

    # as `areal-pipeline train` does before its flow begins (a flow run's threads would rule a fork out later):
    # the run's services are forks with nothing left to import
    forkserver.start_here()
    spawn.spawn_main(**arguments)


def run_prefect_engine(argv: list[str]) -> int:
    """What `python -m prefect.engine *argv` does (a Prefect worker's flow run: PREFECT__FLOW_RUN_ID, ...), in this
    process, after starting its services' forkserver; its exit status."""
    import runpy

    from areal_pipeline import forkserver
    from flows.api_server import exit_code

    forkserver.start_here()  # before the run's threads, as `areal-pipeline train` does
    sys.argv = [sys.argv[0], *argv]
    try:
        runpy.run_module("prefect.engine", run_name="__main__", alter_sys=True)
    except SystemExit as ended:
        return exit_code(ended)
    return 0


def _prefect_engine() -> None:
    """In the fork: a worker's flow run (`areal-pipeline engine`)."""
    redo_prefect_logging()  # as a new interpreter's import of Prefect would have set it up
    code = run_prefect_engine(sys.argv[1:])
    if code:
        raise SystemExit(code)


KEEP_WARM_SECONDS_ENV = "AREAL_WARM_KEEP_SECONDS"  # how often `serve` looks (default 60)


def keep_warm_while_serving(env: dict) -> None:
    """For `serve`, whose runs may come hours apart (a schedule): a daemon thread that every minute tells the
    launcher that runs may come (so it does not end by idleness while `serve` runs) and, where AREAL_WARM=auto and
    none is there (ended, killed), starts one with `env` (as after a cold command)."""
    import threading
    import time

    every = float(os.environ.get(KEEP_WARM_SECONDS_ENV) or 60.0)

    def keep() -> None:
        while True:
            if _ask({"op": "touch"}, timeout=5.0) is None:
                pid = start_for_next_commands(env)
                if pid is not None:
                    print(f"areal-pipeline serve: started a warm launcher for its runs (pid {pid})", flush=True)
            time.sleep(every)

    threading.Thread(target=keep, name="keep the warm launcher", daemon=True).start()


def _wait_until_gone(pid: int, timeout: Optional[float] = None) -> None:
    import time

    deadline = None if timeout is None else time.monotonic() + timeout
    while deadline is None or time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:  # the pid was taken by another user's process: ours is gone
            return
        time.sleep(0.1)


def _spawn(idle_minutes: float, preload_modules: tuple[str, ...] = (), env: Optional[dict] = None):
    """A launcher in the background, in its own session (it outlives the command that starts it)."""
    import subprocess

    path = socket_path()
    with open(path.with_suffix(".log"), "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "flows.warm", "serve", "--socket", str(path),
                                 "--idle-minutes", str(idle_minutes),
                                 *(f"--preload={module}" for module in preload_modules)],
                                env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def start(idle_minutes: float, preload_modules: tuple[str, ...] = (), timeout: float = 120.0) -> dict:
    """Start the launcher in the background and wait until it has imported everything (`preload_modules` too: a
    workflow's or reward's own module, say); its status. One that is still importing (started by a command) is
    waited for instead."""
    import time

    status = _ask({"op": "status"})
    if status is not None:
        return {**status, "already_running": True}
    log_path = socket_path().with_suffix(".log")
    process = None if _launcher_there(socket_path()) else _spawn(idle_minutes, preload_modules)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"the warm launcher exited with code {process.returncode}; see {log_path}")
        status = _ask({"op": "status"})
        if status is not None:
            return status if process is not None else {**status, "already_running": True}
        if process is None and not _launcher_there(socket_path()):  # the one we waited for has ended
            process = _spawn(idle_minutes, preload_modules)
        time.sleep(0.2)
    if process is not None:
        process.terminate()
    raise RuntimeError(f"the warm launcher was not ready within {timeout:.0f} s; see {log_path}")


def start_for_next_commands(env: dict) -> Optional[int]:
    """After a cold command that ran to its end: where `AREAL_WARM` is `auto`, CI is not set and no launcher is
    there, start one in the background with the command's environment (`env`, as the command found it) and do not
    wait for it (seconds of imports, after this command's work), so that the next command starts warm. Its pid,
    or None where none was started."""
    if warm_mode() != "auto" or os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        return None
    if _launcher_there(socket_path()):  # answering or still importing: every launcher holds the lock
        return None
    try:
        return _spawn(AUTO_IDLE_MINUTES, env=env).pid
    except OSError as error:  # the command has done its work: this is no reason to fail it
        print(f"areal-pipeline: no warm launcher started: {error}", file=sys.stderr)
        return None


def stop(timeout: float = 60.0) -> Optional[dict]:
    """Ask the launcher to end (after the runs it started have ended); its last status, or None if none ran."""
    status = _ask({"op": "stop"})
    if status is not None:
        _wait_until_gone(status["pid"], timeout)
    return status


def status() -> Optional[dict]:
    return _ask({"op": "status"})


def _same_interpreter(a: str, b: str) -> bool:
    """The same binary in the same directory (one environment's `python` and `python3`, say)."""
    return os.path.dirname(a) == os.path.dirname(b) and os.path.realpath(a) == os.path.realpath(b)


# ----- the launcher's side --------------------------------------------------------------------------------
def preload(extra: tuple[str, ...] = ()) -> None:
    """Import what `train`, `evaluate` and `sweep` import, their services too, Prefect's API server, and `extra`."""
    import importlib

    # read when torch is imported; the services' forkserver needs it passive (see forkserver.start_here)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from areal_pipeline import forkserver
    from flows.train import FIRST_RUN_IMPORTS

    for module in ("torch", "transformers.models.auto.tokenization_auto", *forkserver.PRELOAD,
                   "areal_pipeline.cli", "areal_pipeline.console", "areal_pipeline.metrics",
                   "flows.train", "flows.evaluate", "flows.sweep", "flows.api_server", "flows.events",
                   "prefect.server.api.server", "uvicorn", "pandas", "pyarrow.dataset",
                   "matplotlib.pyplot",  # the reward curve at a run's end
                   "areal_pipeline.rewards.math",  # math-verify: the reward workers are forks of the run's forkserver
                   *FIRST_RUN_IMPORTS):
        try:
            importlib.import_module(module)
        except ImportError:  # an optional one (another Prefect version): the run imports it if it needs it
            pass
    for module in extra:  # asked for by name: a failure is the user's to see
        importlib.import_module(module)


def _loaded_files() -> dict[str, tuple[int, int]]:
    files = {}
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if path:
            try:
                stat = os.stat(path)
            except OSError:
                continue
            files[path] = (stat.st_mtime_ns, stat.st_size)
    return files


def _changed_file(files: dict[str, tuple[int, int]]) -> Optional[str]:
    for path, seen in files.items():
        try:
            stat = os.stat(path)
        except OSError:
            return path
        if (stat.st_mtime_ns, stat.st_size) != seen:
            return path
    return None


class Launcher:
    def __init__(self, path: Path, idle_seconds: float, argv: list[str], lock_fd: int):
        import time

        self.argv = argv  # to start afresh with
        self.lock_fd = lock_fd
        self.path = path
        self.idle_seconds = idle_seconds
        self.files = _loaded_files()
        self.packages = {name: getattr(sys.modules.get(name), "__file__", None) for name in PROJECT_PACKAGES}
        self.import_env = {k: v for k, v in os.environ.items() if k.startswith(IMPORT_TIME_ENV_PREFIXES)}
        self.started = time.time()
        self.last_activity = time.monotonic()
        self.runs_started = 0
        self.runs: dict[int, socket.socket] = {}  # pid -> the connection of the command it runs
        self.watched: set[socket.socket] = set()  # connections of runs whose command is still there
        self.stopping = False
        self.restart = False  # a file it imported changed: it execs itself anew once its runs have ended
        self.prefect_env = {k: v for k, v in os.environ.items() if k.startswith("PREFECT_")}
        self.process = _process_settings()  # its limits, priority and CPUs: a fork keeps them
        import subprocess

        self.interpreter_flags = subprocess._args_from_interpreter_flags()  # what multiprocessing passes on
        self.api = None  # Prefect's API for runs that configure none (what each would otherwise start for itself)

    def why_cold(self, request: dict) -> Optional[str]:
        if request.get("entry", "cli") not in ENTRIES:
            return f"no such entry: {request.get('entry')}"
        if request.get("entry") == "mp-spawn":
            flags = (request.get("argv") or [])[1:-3]  # EXE [flags] -c PROGRAM --multiprocessing-fork
            if flags != self.interpreter_flags:
                return f"interpreter flags {' '.join(flags)} are not the launcher's"
        if not _same_interpreter(request.get("executable") or "", sys.executable):
            return f"the command's interpreter {request.get('executable')} is not the launcher's {sys.executable}"
        for name, origin in (request.get("packages") or {}).items():
            if origin != self.packages.get(name):
                return f"the command finds {name} at {origin}, the launcher imported {self.packages.get(name)}"
        env = request.get("env") or {}
        theirs = {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV_PREFIXES)}
        theirs.setdefault("OMP_WAIT_POLICY", self.import_env.get("OMP_WAIT_POLICY"))
        if theirs != self.import_env:
            names = sorted(k for k in set(theirs) | set(self.import_env) if theirs.get(k) != self.import_env.get(k))
            return f"environment variables read at import differ from the launcher's: {', '.join(names)}"
        for key, what in (("limits", "resource limits (ulimit)"), ("nice", "priority (nice)"),
                          ("cpus", "CPU affinity (taskset)")):
            if (request.get("process") or {}).get(key) != self.process[key]:
                return f"the {what} of the command and of the launcher differ"
        changed = _changed_file(self.files)
        if changed is not None:
            self.restart = True
            return f"{changed} changed since the warm launcher imported it (it restarts)"
        return None

    def serve(self) -> None:
        import select
        import time

        listener = socket.socket(socket.AF_UNIX)
        with _private_umask():
            self._bind(listener)
        from flows.api_server import TemporaryAPIServer, configured_api_url

        if configured_api_url() is None:
            # a fork of this process (seconds of imports saved once more), answering before the first command
            # connects (its database may be new: Prefect's migrations take seconds); a command that connects
            # before `listen` is refused and starts cold
            self.api = TemporaryAPIServer()
            try:
                self.api.wait_ready()
            except RuntimeError as error:
                print(f"no Prefect API for the runs: {error}", flush=True)
                self.api = None
        listener.listen(16)
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stopping", True))
        self.keep_fds = {listener.fileno(), wake_r, wake_w, self.lock_fd}  # a run's fork closes them
        print(f"warm launcher {os.getpid()} ready on {self.path} ({len(self.files)} files imported)", flush=True)
        try:
            while self.runs or not (self.stopping or self.restart):
                waiting = [wake_r, listener, *self.watched]
                readable, _, _ = select.select(waiting, [], [], 5.0)
                if wake_r in readable:
                    while True:
                        try:
                            if not os.read(wake_r, 512):
                                break
                        except BlockingIOError:
                            break
                self._reap()
                for conn in readable:
                    if conn is listener:
                        self._accept(listener)
                    elif isinstance(conn, socket.socket):
                        self._command_gone(conn)
                if (not self.runs and not self.stopping
                        and time.monotonic() - self.last_activity > self.idle_seconds):
                    print(f"idle for {self.idle_seconds / 60:.0f} min: ending", flush=True)
                    break
        finally:
            self._unbind(listener)
            if self.api is not None:
                self.api.stop()
        if self.restart and not self.stopping:
            print("restarting: a file it imported changed", flush=True)
            os.execv(sys.executable, [sys.executable, "-m", "flows.warm", *self.argv])

    def _bind(self, listener: socket.socket) -> None:
        if self.path.exists():  # a launcher that answers keeps its socket; a dead one's file is taken over
            try:
                with socket.socket(socket.AF_UNIX) as probe:
                    probe.connect(str(self.path))
                raise SystemExit(f"a warm launcher already answers on {self.path}")
            except ConnectionRefusedError:
                self.path.unlink()
        listener.bind(str(self.path))
        self.bound_inode = os.stat(self.path).st_ino

    def _unbind(self, listener: socket.socket) -> None:
        try:  # only the file this launcher made: another may have taken the path over since
            if os.stat(self.path).st_ino == self.bound_inode:
                self.path.unlink()
        except OSError:
            pass
        listener.close()

    def status(self) -> dict:
        import time

        return {"pid": os.getpid(), "socket": str(self.path), "started": self.started,
                "uptime_s": round(time.time() - self.started, 1), "runs_started": self.runs_started,
                "idle_minutes": self.idle_seconds / 60,
                "running": sorted(self.runs), "files": len(self.files), "stopping": self.stopping,
                "prefect_api": None if self.api is None else self.api.url}

    def _accept(self, listener: socket.socket) -> None:
        import time

        conn, _ = listener.accept()
        self.last_activity = time.monotonic()
        fds: list[int] = []
        try:
            conn.settimeout(10.0)
            _, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                            struct.calcsize("3i")))
            if uid != os.getuid():
                conn.close()
                return
            request, fds = _receive_request(conn)
            op = request.get("op")
            if op == "status":
                conn.sendall(json.dumps(self.status()).encode() + b"\n")
            elif op == "touch":  # a `serve` is there to start runs: not idle
                self.last_activity = time.monotonic()
                conn.sendall(json.dumps(self.status()).encode() + b"\n")
            elif op == "stop":
                self.stopping = True
                conn.sendall(json.dumps(self.status()).encode() + b"\n")
            elif op == "run" and len(fds) == len(request.get("fd_targets") or (0, 1, 2)) >= 3:
                reason = ("the warm launcher is ending" if self.stopping or self.restart
                          else self.why_cold(request))
                if reason is not None:
                    conn.sendall(json.dumps({"cold": reason}).encode() + b"\n")
                else:
                    conn.settimeout(None)
                    self._fork_run(request, fds, conn, api_url=self._api_for(request))
                    return  # the connection stays open until the run ends
            conn.close()
        except (OSError, ValueError, ConnectionError) as error:
            print(f"a request failed: {error}", flush=True)
            conn.close()
        finally:
            for fd in fds:
                os.close(fd)

    def _api_for(self, request: dict) -> Optional[str]:
        """The launcher's Prefect API, for a run whose Prefect settings are the launcher's (a run that names an
        API, another home or database starts as it would have)."""
        env = request.get("env") or {}
        if self.api is None or {k: v for k, v in env.items() if k.startswith("PREFECT_")} != self.prefect_env:
            return None
        if self.api.popen is None or self.api.popen.poll() is not None:
            self.api = None
            return None
        return self.api.url

    def _fork_run(self, request: dict, fds: list[int], conn: socket.socket, api_url: Optional[str]) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _become_command(request, fds, api_url, close=[conn.fileno(), *self.keep_fds,
                                                                      *(c.fileno() for c in self.runs.values())])
            finally:
                os._exit(code)
        self.runs_started += 1
        self.runs[pid] = conn
        self.watched.add(conn)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        print(f"run {pid}: {' '.join(request['argv'][1:])} (in {request['cwd']})", flush=True)

    def _reap(self) -> None:
        import time

        while self.runs:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.runs.pop(pid, None)
            if conn is None:
                continue
            self.watched.discard(conn)
            code = os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code  # killed by signal N: the shell's 128 + N
            self.last_activity = time.monotonic()  # idle from the end of its last run
            print(f"run {pid} ended: {code}", flush=True)
            try:
                conn.sendall(json.dumps({"exit": code}).encode() + b"\n")
            except OSError:
                pass
            conn.close()

    def _command_gone(self, conn: socket.socket) -> None:
        """The command that a run belongs to closed its connection (it was killed): stop the run, as a stop
        signal to the command would have."""
        try:
            if conn.recv(1):
                return
        except OSError:
            pass
        self.watched.discard(conn)
        for pid, run_conn in self.runs.items():
            if run_conn is conn:
                print(f"run {pid}: its command is gone: SIGTERM", flush=True)
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass


class _private_umask:
    def __enter__(self):
        self.before = os.umask(0o177)

    def __exit__(self, *exc):
        os.umask(self.before)


def _become_command(request: dict, fds: list[int], api_url: Optional[str], close: list[int]) -> int:
    """In the fork: become `areal-pipeline *argv` as started from the command's terminal, directory and
    environment, run it, and return its exit status as a new interpreter would end with."""
    import atexit
    import random
    import threading
    import traceback

    os.setsid()  # its own process group: the command forwards the terminal's signals, the run stops its own
    signal.set_wakeup_fd(-1)
    for signum in (signal.SIGCHLD, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import fcntl

    for fd in close:
        os.close(fd)
    # each descriptor under the number the command has it under (moved above every target first: a target may be
    # the number a received one has)
    targets = request.get("fd_targets") or list(range(len(fds)))
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, max(targets) + 1) for fd in fds]
    for fd in fds:
        os.close(fd)
    for target, fd in zip(targets, moved):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    omp_wait_policy = os.environ.get("OMP_WAIT_POLICY")  # the policy OpenMP read when torch was imported here
    os.environ.clear()
    os.environ.update(request["env"])
    if omp_wait_policy is not None:
        os.environ.setdefault("OMP_WAIT_POLICY", omp_wait_policy)
    sys.argv = list(request["argv"])
    sys.path[:] = request["path"]
    import tempfile

    tempfile.tempdir = None  # cached at its first use in the launcher: found again from the command's TMPDIR
    # as a new interpreter: stdout line-buffered on a terminal only, each RNG seeded afresh
    sys.stdout.reconfigure(line_buffering=os.isatty(1))
    sys.stderr.reconfigure(line_buffering=True)
    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    from setproctitle import setproctitle

    setproctitle(" ".join(sys.argv))  # within the room the launcher's own title found
    if api_url is not None and _answers(api_url):
        os.environ["PREFECT_API_URL"] = api_url
    from prefect.context import refresh_global_settings_context

    refresh_global_settings_context()
    _undo_prefect_logging()
    import importlib

    module, _, function = ENTRIES[request.get("entry", "cli")].partition(":")
    entry = getattr(importlib.import_module(module), function)
    code = 0
    try:
        if module == "areal_pipeline.cli":
            entry(sys.argv[1:])  # explicit: with none, the command line would ask the launcher again
        else:
            entry()
    except SystemExit as ended:
        from flows.api_server import exit_code

        code = exit_code(ended)
    except KeyboardInterrupt:
        code = 128 + signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    # what a new interpreter does on its way out: wait for its non-daemon threads, then its exit handlers
    shutdown_threads = getattr(threading, "_shutdown", None)
    if shutdown_threads is not None:
        shutdown_threads()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code


def _answers(api_url: str) -> bool:
    import urllib.request

    try:
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(f"{api_url}/health", timeout=5) as reply:
            return reply.status == 200
    except OSError:
        return False


_prefect_logging_undone = False


def _undo_prefect_logging() -> None:
    """Logging as a new interpreter starts: Prefect configured it when the launcher imported it, but a command
    configures the root logger first and imports Prefect later (which then leaves the root logger alone)."""
    global _prefect_logging_undone
    import logging

    from prefect.logging.configuration import PROCESS_LOGGING_CONFIG

    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)
    # Prefect's handlers on other loggers too (PREFECT_LOGGING_EXTRA_LOGGERS): set-up adds them again
    for logger in list(logging.Logger.manager.loggerDict.values()):
        for handler in list(getattr(logger, "handlers", ())):
            if type(handler).__module__.startswith("prefect."):
                logger.removeHandler(handler)
    PROCESS_LOGGING_CONFIG.clear()
    _prefect_logging_undone = True


def redo_prefect_logging() -> None:
    """Prefect's logging set-up where a command would have run it (its import), after the command's own; a no-op
    outside a fork of the launcher."""
    global _prefect_logging_undone
    if _prefect_logging_undone:
        from prefect.logging.configuration import setup_logging

        setup_logging(incremental=False)
        _prefect_logging_undone = False


def main(argv: Optional[list[str]] = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["serve"])
    parser.add_argument("--socket", required=True)
    parser.add_argument("--idle-minutes", type=float, default=240.0)
    parser.add_argument("--preload", action="append", default=[], metavar="MODULE")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    from setproctitle import setproctitle

    setproctitle(f"areal-pipeline warm launcher {args.socket}")
    lock_fd = _hold_launcher_lock(Path(args.socket))  # released at exit, and at a restart's exec (close-on-exec)
    preload(tuple(args.preload))
    import threading

    if threading.active_count() != 1:  # a fork would hold the other threads' locks for ever
        raise SystemExit(f"the preloaded modules started threads: {[t.name for t in threading.enumerate()]}")
    Launcher(Path(args.socket), args.idle_minutes * 60, argv, lock_fd).serve()


if __name__ == "__main__":
    from flows import warm  # this module once more under its own name, where a run's code finds its state

    warm.main()
