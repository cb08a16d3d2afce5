"""Shared fixtures: the embedded tiny model and real CPU inference servers on loopback."""

from __future__ import annotations

import json
import os
import socket
import sys
import urllib.error
from pathlib import Path

import pytest

from areal_pipeline import auth
from areal_pipeline.processes import ServerProcess
from areal_pipeline.utils import find_free_port

# The session's credential, as a run has one: every service a test starts demands it (auth is on by default),
# every client of the project sends it; the xdist workers and every process a test starts inherit it.
if not auth.auth_disabled():
    os.environ.setdefault(auth.TOKEN_ENV, auth.new_token())

# The xdist workers share the machine's cores: each worker, and every process it starts, gets its share as torch's
# default thread count (OMP_NUM_THREADS, read when torch loads). Without it every trainer of every worker runs one
# thread a core, and on 2 cores with both workers busy their threads spin waiting on each other. A setting the
# environment already has, or a config's own num_threads, is kept.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _WORKERS)))

# Prefect's server waits on its own clock where a test waits on it: a run that finds its deployment's one-at-a-time
# slot taken is rescheduled 30 s later (AwaitingConcurrencySlot), a client of a global limit is told to retry up to
# 30 s later, events and task runs are written every 5 s (a test reading them waited for the next write), a new
# deployment's schedule is read every 5 s. The servers the tests start (and every temporary API) do each within
# seconds; what waits for what is the same.
for _setting, _seconds in {"PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS": "2",
                           "PREFECT_SERVER_CONCURRENCY_MAXIMUM_CONCURRENCY_SLOT_WAIT_SECONDS": "2",
                           "PREFECT_SERVER_TASKS_TAG_CONCURRENCY_SLOT_WAIT_SECONDS": "2",
                           "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "1",
                           "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_FLUSH_INTERVAL": "1",
                           "PREFECT_SERVER_SERVICES_SCHEDULER_RECENT_DEPLOYMENTS_LOOP_SECONDS": "1"}.items():
    os.environ.setdefault(_setting, _seconds)

# The full data sets, where the checkout sits beside ../shared; tests/data holds small slices of the same data in
# the same layouts, so that every test of real rows runs in every checkout (tests/data/README.md).
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
TEST_DATA = Path(__file__).resolve().parent / "data"


def data_dirs(name: str) -> list:
    """pytest params of the folders holding data set `name`: the bundled slice always, the full data set where it
    is present (a variant for tests whose point is the whole set; the bundled slice covers the capability)."""
    return [pytest.param(TEST_DATA / name, id="bundled")] + (
        [pytest.param(SHARED_DATA / name, id="shared")] if (SHARED_DATA / name).is_dir() else [])


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from areal_pipeline.model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny", seed=1)


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """A folder shared by every xdist worker of this test session, for embedded models that several test files
    warm-start from the same config (tests/_learning_helpers.py `base_model`, which locks while it builds)."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    (root / "model-cache").mkdir(exist_ok=True)
    return root / "model-cache"


@pytest.fixture(scope="session")
def default_base_model(model_cache) -> str:
    """The CPU default's warm-started base (configs/tiny_cpu.yaml), built once for the session's workers."""
    from _learning_helpers import base_model

    return base_model("tiny_cpu.yaml", model_cache)


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory):
    """A temporary Prefect API (SQLite) for every test of this worker that asks for one; CLI subprocesses use it
    through PREFECT_API_URL. Tests tell their runs apart by run id, never by counting a table's rows."""
    home = tmp_path_factory.mktemp("prefect-home")
    os.environ["PREFECT_HOME"] = str(home)
    import flows  # noqa: F401  (sets the project's Prefect defaults before Prefect is configured)
    # Prefect configures logging when its main module is first imported, replacing the root logger's handlers: a
    # test that imports it first (a flow run alone) would lose caplog's handler before anything is logged.
    import prefect.main  # noqa: F401
    from prefect.settings import PREFECT_API_URL
    from prefect.testing.utilities import prefect_test_harness

    from _prefect_server import drain_prefect_workers

    with prefect_test_harness(server_startup_timeout=120):
        yield PREFECT_API_URL.value()
        drain_prefect_workers()  # within a deadline: the harness's own drain has none


SESSION_TEMP: list = []  # the folder every test's tmp_path of this session is under (every xdist worker's)


@pytest.fixture(scope="session", autouse=True)
def session_temp(tmp_path_factory) -> Path:
    base = tmp_path_factory.getbasetemp()
    SESSION_TEMP[:] = [base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base]
    return SESSION_TEMP[0]


def start_cpu_server(model_dir: Path, log_dir: Path, *extra: str, deterministic: bool = True,
                     port: int = 0, session_root: bool = True) -> ServerProcess:
    """`deterministic`: honour sampling_seed, as the project's launcher starts it (SGLang's flag); `port`: this one
    (0: a free one). It loads weights from disk under the session's temp folder (every test's tmp_path) unless
    `extra` names its own --weights-root, or `session_root` is False."""
    port = port or find_free_port()
    roots = [] if "--weights-root" in extra or not session_root else ["--weights-root", str(SESSION_TEMP[0])]
    command = [sys.executable, "-m", "areal_pipeline.inference.server", "--model", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port), "--seed", "0", *roots, *extra,
               *(["--enable-deterministic-inference"] if deterministic else [])]
    # forked from this worker's services forkserver, as a run forks its CPU servers: the forkserver imports torch
    # and transformers once, where each launched server imported them again (seconds of CPU a test)
    from areal_pipeline.inference.launcher import forked_cpu_server
    from areal_pipeline.services import start_forkserver

    start_forkserver()
    server = ServerProcess(command, f"127.0.0.1:{port}", log_dir / f"server-{port}.log",
                           fork=forked_cpu_server(command)).start()
    server.wait_healthy(120)
    return server


@pytest.fixture(scope="session")
def cpu_server(tiny_model_dir, tmp_path_factory):
    """One CPU server for the whole session (per xdist worker); tests must leave it unpaused."""
    server = start_cpu_server(tiny_model_dir, tmp_path_factory.mktemp("server-logs"))
    yield server.address
    server.stop()


def http(address: str, path: str, body=None, method: str | None = None, timeout: float = 60):
    """(status, parsed JSON or text) of one HTTP call; errors are returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    req = auth.request(address, path, data=data, method=method or ("POST" if data else "GET"),
                       headers={"Content-Type": "application/json"})
    try:
        with auth.opener().open(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return status, raw.decode()


@pytest.fixture
def dead_address():
    """'127.0.0.1:PORT' where nothing answers: a socket holds the port bound but not listening for the test's length,
    so every connection is refused and no other process (a parallel worker's server) can take the port meanwhile,
    as it could a port chosen and left unbound."""
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{bound.getsockname()[1]}"


# --- Nothing left behind ----------------------------------------------------------------------------------------
# Every process a test starts inherits the session's mark (tests/_reaper.py); a reaper of its own waits for pytest's
# main process to end, however it ends (a SIGTERM or a CI time-out runs no teardown), and stops what is still marked.


REAPER_SCRIPT = Path(__file__).with_name("_reaper.py")
REAPER: list = []  # its Popen, kept for the session's length


def pytest_configure(config):
    # the workers inherit the main process's mark; a conftest copied elsewhere (tests/test_ci_skips.py) has no
    # reaper beside it; a pytest run inside a test keeps its session's mark
    if os.environ.get("PYTEST_XDIST_WORKER") or not REAPER_SCRIPT.is_file():
        return
    import subprocess
    import uuid

    from _reaper import SESSION_MARK

    if os.environ.get(SESSION_MARK):
        return
    os.environ[SESSION_MARK] = uuid.uuid4().hex
    REAPER.append(subprocess.Popen(
        [sys.executable, str(REAPER_SCRIPT), str(os.getpid()), os.environ[SESSION_MARK]],
        start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))


# --- Temp files of the processes the tests start ---------------------------------------------------------------
# A server, trainer or torchrun agent a test kills on purpose leaves its own temp dirs behind (multiprocessing's
# pymp-*, torchrun's torchelastic_*). With TMPDIR under this session's pytest temp dir, which pytest rotates, they
# do not pile up in /tmp.


@pytest.fixture(scope="session", autouse=True)
def processes_temp_dir(tmp_path_factory):
    import tempfile

    directory = str(tmp_path_factory.mktemp("tmp"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", directory)
        patch.setattr(tempfile, "tempdir", directory)
        yield directory


# --- Longest files first -------------------------------------------------------------------------------------
# `make test` hands whole files to the xdist workers (--dist loadfile) in collection order (--no-loadscope-reorder):
# ordered by their recorded seconds (tests/durations.json, refreshed by tests/_durations.py), the long files start
# at once and the short ones fill the gaps, instead of one long file running alone at the end.
UNRECORDED_FILE_SECONDS = 30


def pytest_collection_modifyitems(session, config, items):
    recorded = Path(__file__).parent / "durations.json"
    if not recorded.is_file():  # a conftest copied elsewhere (tests/test_ci_skips.py) keeps pytest's order
        return
    seconds = json.loads(recorded.read_text())
    items.sort(key=lambda item: -seconds.get(item.path.name, UNRECORDED_FILE_SECONDS))  # stable: a file stays whole


# --- Under CI a skip is a failure, unless it is for a GPU --------------------------------------------------------
# A skipped test checks nothing, and a summary line "N skipped" hides which capability went untested. Where CI is
# set (CI=true, as CI services set it), a skip fails the test with its reason, unless the reason says the test
# needs (or must not have) a GPU: it begins with one of GPU_REASONS. Self-contained so that it merges beside other edits.


def _ci_forbids_skips() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


GPU_REASONS = ("this machine has a GPU", "needs a GPU", "needs CUDA")  # how a skip's reason must begin


def _skip_allowed_under_ci(reason: str) -> bool:
    return reason.removeprefix("Skipped: ").startswith(GPU_REASONS)


def _fail_a_skip_under_ci(report) -> None:
    if not report.skipped or hasattr(report, "wasxfail") or not _ci_forbids_skips():
        return
    reason = _skip_reason(report)
    if not _skip_allowed_under_ci(reason):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI (CI={os.environ['CI']}), which only a GPU reason may: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_a_skip_under_ci(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_a_skip_under_ci(outcome.get_result())
