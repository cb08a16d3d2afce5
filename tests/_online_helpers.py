"""What the tests of a line that learns from its served traffic share (test_online_line.py, test_online_firings.py):
configs/online_cpu.yaml, one firing in this process, a round of the simulated user, and what was recorded and taken."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _learning_helpers import base_model
from _prefect_server import server  # noqa: F401 (server: a fixture)
from test_flows import REPO

CONFIG = REPO / "configs" / "online_cpu.yaml"
USER = REPO / "examples" / "simulated_user.py"


# module fixtures the test files import: a Prefect server of their own (_prefect_server.py), and the line's embedded base model
@pytest.fixture(scope="module")
def base(model_cache) -> str:
    return base_model("online_cpu.yaml", model_cache)


def line_of(overrides: list[str]):
    from areal_pipeline.recurring.line import Line
    from areal_pipeline.run_spec import load_config

    return Line(load_config(CONFIG, overrides))


def fire(api_url: str, overrides: list[str]) -> dict:
    """One firing of the line in this process, reporting to the Prefect server at `api_url`."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.recurring import recurring

    with temporary_settings(updates={PREFECT_API_URL: api_url}):
        return recurring(config_path=str(CONFIG), overrides=overrides)


def simulated_user(overrides: list[str], round_: int, **options) -> dict:
    """A round of examples/simulated_user.py against the line's server: its last line's figures."""
    args = [f"--{k}={v}" for k, v in options.items()]
    done = subprocess.run([sys.executable, str(USER), "--config", str(CONFIG), f"--round={round_}", *args,
                           *overrides], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def recorded(line) -> tuple[list[dict], list[dict]]:
    """(the line's recorded samples, its feedback), every shard and journal intact."""
    from areal_pipeline.online.traffic_log import read_records

    samples, problems = read_records(line.dir / "traffic", "requests")
    feedback, feedback_problems = read_records(line.dir / "traffic", "feedback")
    assert problems == [] and feedback_problems == []
    return samples, feedback


def taken_by(line, firing: int) -> dict[str, str]:
    """What firing `firing` took of the traffic: sample id -> why (trained, expired, stale, gate)."""
    return json.loads((line.firing_dir(firing) / "traffic.json").read_text())["taken"]
