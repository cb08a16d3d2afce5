"""What `areal-pipeline train` starts before its own imports: the temporary Prefect API server (unless an API may be
configured), which needs the command to reach it without importing torch first; then the forkserver, a fork of the
command once it has imported what its services need."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PARSER_IMPORTS = """
import sys
import cli
cli.build_parser()
print(sorted(m for m in ("torch", "transformers", "aiohttp", "numpy", "prefect") if m in sys.modules))
"""


def test_building_the_command_line_imports_nothing_heavy():
    done = subprocess.run([sys.executable, "-c", PARSER_IMPORTS], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"


EARLY_SERVER = """
import json, sys, urllib.request
from flows.api_server import early_api_server, needed_api_server
early = early_api_server()
started = early is not None
used = needed_api_server(early)
early_stopped = started and early.popen is None
answer = None
if used is not None:
    with urllib.request.urlopen(used.wait_ready() + "/health", timeout=10) as reply:
        answer = reply.status
    used.stop()
print(json.dumps({"early": started, "early_stopped": early_stopped, "used": used is not None,
                  "health": answer}))
"""


def _early_server(tmp_path: Path, **env: str) -> dict:
    import json

    clean = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    clean.update(PREFECT_HOME=str(tmp_path / "prefect-home"), **env)
    work = tmp_path / "cwd"
    work.mkdir(exist_ok=True)
    done = subprocess.run([sys.executable, "-c", EARLY_SERVER], cwd=work, capture_output=True, text=True,
                          timeout=300, env={**clean, "PYTHONPATH": str(REPO)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_temporary_api_server_starts_early_where_no_api_is_configured(tmp_path):
    assert _early_server(tmp_path) == {"early": True, "early_stopped": False, "used": True, "health": 200}


def test_no_early_server_where_the_environment_names_an_api(tmp_path):
    figures = _early_server(tmp_path, PREFECT_API_URL="http://127.0.0.1:9/api")
    assert figures == {"early": False, "early_stopped": False, "used": False, "health": None}


def test_a_profile_that_names_an_api_is_read_by_prefect_and_no_server_starts(tmp_path):
    home = tmp_path / "prefect-home"
    home.mkdir()
    (home / "profiles.toml").write_text('active = "team"\n\n[profiles.team]\nPREFECT_API_URL = "http://127.0.0.1:9/api"\n')
    figures = _early_server(tmp_path)
    assert figures == {"early": False, "early_stopped": False, "used": False, "health": None}


def test_an_early_server_is_stopped_when_prefect_settings_name_an_api(tmp_path):
    # prefect.toml in the working directory: the cheap look cannot tell what it sets, so it leaves the decision to
    # Prefect's settings; a .env naming the API in an unusual spelling is found only by Prefect
    work = tmp_path / "cwd"
    work.mkdir()
    (work / ".env").write_text("prefect_api_url=http://127.0.0.1:9/api\n")
    figures = _early_server(tmp_path)
    assert figures == {"early": True, "early_stopped": True, "used": False, "health": None}


FORKSERVER_KIND = """
import os, signal, sys, threading, time
import psutil
os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
from areal_pipeline import forkserver, shutdown
from multiprocessing import forkserver as mp_forkserver
shutdown.install_handlers()  # as the command has its stop handlers when it forks
if sys.argv[1] == "thread":
    threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
forkserver.start_here()
server = psutil.Process(mp_forkserver._forkserver._forkserver_pid)
for _ in range(100):  # the fork names itself once it runs
    titled = " ".join(server.cmdline()).strip() == f"multiprocessing.forkserver of {os.getpid()}"
    if titled:
        break
    time.sleep(0.05)
service = forkserver.fork_service("signal_probe", [sys.argv[2]], sys.argv[2] + ".log", dict(os.environ))
service.wait(120)
print(server.ppid() == os.getpid(), titled, open(sys.argv[2]).read())
"""

SIGNAL_PROBE = """
import signal
def main(argv):
    with open(argv[0], "w") as out:
        out.write(f"{signal.getsignal(signal.SIGINT) is signal.default_int_handler}-"
                  f"{signal.getsignal(signal.SIGTERM) == signal.SIG_DFL}")
"""


def test_the_forkserver_is_a_fork_of_the_command_unless_a_thread_runs(tmp_path):
    """A fork copies only the forking thread: another thread's locks would stay held in the copy for ever, so a
    process with threads starts a new interpreter as its forkserver instead. Either way a service starts with a
    new interpreter's signal handlers, not the command's stop handlers."""
    (tmp_path / "signal_probe.py").write_text(SIGNAL_PROBE)
    kinds = {}
    for setting in ("alone", "thread"):
        done = subprocess.run([sys.executable, "-c", FORKSERVER_KIND, setting, str(tmp_path / setting)], cwd=REPO,
                              capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}"})
        assert done.returncode == 0, done.stderr[-3000:]
        kinds[setting] = done.stdout.split()
    assert kinds == {"alone": ["True", "True", "True-True"], "thread": ["True", "False", "True-True"]}


IMPORT_AHEAD = """
import sys
from areal_pipeline.utils import import_in_background
before = "pandas" in sys.modules
import_in_background("no_such_module_here", "pandas").join(120)
print(before, "pandas" in sys.modules)
"""


def test_modules_imported_ahead_in_the_background_skipping_missing_ones():
    """What the first shard write and the trainer's first read import (pandas, pyarrow.dataset) is imported while
    the process waits; a module that is not installed is left to whoever needs it."""
    done = subprocess.run([sys.executable, "-c", IMPORT_AHEAD], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "True"]
