"""A test session killed from outside leaves no process behind (tests/_reaper.py): a pytest run of the project's
conftest whose test starts a detached server-like process is sent SIGTERM, and the process is gone soon after."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from _reaper import SESSION_MARK, alive, reap
from test_flows import wait_until

TESTS = Path(__file__).resolve().parent

DETACHED_TEST = """
import os, subprocess, sys, time
from pathlib import Path

def test_starts_a_detached_process_and_hangs():
    # a session and process group of its own, as the project's servers: no signal to pytest's group reaches it
    child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); time.sleep(600)"], start_new_session=True)
    Path({pid_file!r}).write_text(str(child.pid))
    time.sleep(600)
"""


def test_a_session_killed_by_sigterm_leaves_no_process_behind(tmp_path):
    suite = tmp_path / "suite"
    suite.mkdir()
    for name in ("conftest.py", "_reaper.py"):
        shutil.copy(TESTS / name, suite / name)
    pid_file = tmp_path / "child.pid"
    (suite / "test_detached.py").write_text(textwrap.dedent(DETACHED_TEST.format(pid_file=str(pid_file))))
    env = {k: v for k, v in os.environ.items() if k not in (SESSION_MARK, "PYTEST_XDIST_WORKER")}
    session = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-n", "1", "-p", "no:cacheprovider",
                                str(suite)], cwd=suite, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: pid_file.is_file() and pid_file.read_text(), 120, "the test's detached process")
        child = int(pid_file.read_text())
        assert alive(child)
        session.send_signal(signal.SIGTERM)
        session.wait(60)
        # it ignores SIGTERM, so the reaper's SIGKILL after its grace is what ends it
        wait_until(lambda: not alive(child), 60, f"the reaper to stop process {child}")
    finally:
        if session.poll() is None:
            session.kill()
            session.wait(10)


def test_this_session_is_marked():
    assert os.environ.get(SESSION_MARK)  # the workers inherit the mark conftest.py set in pytest's main process


def test_the_reaper_stops_marked_processes_and_kills_those_that_ignore_sigterm(tmp_path):
    mark = f"reaper-test-{os.getpid()}"
    env = {**os.environ, SESSION_MARK: mark}
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], env=env)
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                 "signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"],
                                env=env, stdout=subprocess.PIPE, text=True)
    unmarked = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                env={k: v for k, v in os.environ.items() if k != SESSION_MARK})
    try:
        assert stubborn.stdout.readline().strip() == "ready"
        found = reap(mark, grace_s=2)
        assert sorted(found) == sorted([polite.pid, stubborn.pid])
        assert polite.wait(10) == -signal.SIGTERM and stubborn.wait(10) == -signal.SIGKILL
        assert unmarked.poll() is None
    finally:
        for process in (polite, stubborn, unmarked):
            process.kill()
            process.wait(10)
