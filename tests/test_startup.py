"""What `areal-pipeline train` starts before its own imports: the temporary Prefect API server (unless an API may be
configured), which needs the command to reach it without importing torch first; then the services' forkserver,
which imports what the command tells it to."""

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


FORKSERVER_PRELOAD = """
import os, sys
from areal_pipeline import forkserver, shutdown
shutdown.install_handlers()  # as the command has its stop handlers when it starts the forkserver
forkserver.start(["preloaded_probe"])
service = forkserver.fork_service("signal_probe", [sys.argv[1]], sys.argv[1] + ".log", dict(os.environ))
(server,) = [p for p in forkserver.processes_of(os.getpid())
            if p.pid != service.pid and "multiprocessing.forkserver" in " ".join(p.cmdline())]
print("preloaded_probe" in sys.modules, server.ppid() == os.getpid(), flush=True)
service.wait(120)
print(open(sys.argv[1]).read())
"""

PRELOADED_PROBE = """
import os
IMPORTED_BY = os.getpid()
"""

SIGNAL_PROBE = """
import os, signal, sys
def main(argv):
    import preloaded_probe
    with open(argv[0], "w") as out:
        out.write(f"{signal.getsignal(signal.SIGINT) is signal.default_int_handler}-"
                  f"{signal.getsignal(signal.SIGTERM) == signal.SIG_DFL}-"
                  f"{preloaded_probe.IMPORTED_BY == os.getppid()}")
"""


def test_the_forkserver_imports_what_its_caller_names_and_services_start_with_fresh_handlers(tmp_path):
    """The forkserver is a process of the command's that imports the modules the command names (not the command
    itself): a service forked from it finds them imported by the forkserver, and starts with a new interpreter's
    signal handlers, not the command's stop handlers."""
    (tmp_path / "signal_probe.py").write_text(SIGNAL_PROBE)
    (tmp_path / "preloaded_probe.py").write_text(PRELOADED_PROBE)
    done = subprocess.run([sys.executable, "-c", FORKSERVER_PRELOAD, str(tmp_path / "probe")], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path}", "AREAL_FORKSERVER": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "True", "True-True-True"], done.stdout + done.stderr[-3000:]


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
