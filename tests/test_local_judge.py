"""A judge the run serves itself (judge.serve, areal_pipeline/rewards/local_judge.py): the config's rules, the judge
server's life with the run's services (started, started again where it died, stopped), and re-scoring's own."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from areal_pipeline.config import ConfigError
from areal_pipeline.run_spec import load_config

REPO = Path(__file__).resolve().parents[1]


def ask(base_url: str) -> dict:
    """One chat completion of the judge at `base_url`, as the judge reward asks it."""
    body = json.dumps({"model": "local-judge", "max_tokens": 4, "temperature": 0,
                       "messages": [{"role": "user", "content": "Question:\nWhat is 1+1?"}]}).encode()
    request = urllib.request.Request(base_url + "/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())


SERVED = ["rollout.group_reward=judge", "rollout.gconfig.n_samples=4", "judge.serve=true", "judge.max_tokens=16"]


def served_cfg(tmp_path: Path, model_dir: Path, *more: str):
    return load_config(str(REPO / "configs/tiny_cpu.yaml"),
                       [f"output_dir={tmp_path}", *SERVED, f"judge.model_path={model_dir}", *more])


def test_a_served_judge_needs_its_model_and_takes_no_endpoint():
    tiny_cpu = str(REPO / "configs/tiny_cpu.yaml")
    cfg = load_config(tiny_cpu, [*SERVED, "judge.model_path=/models/judge"])
    assert cfg.judge.serve and cfg.judge.model_path == "/models/judge" and not cfg.judge.base_url
    with pytest.raises(ConfigError, match=r"judge.base_url='http://h/v1' with judge.serve=true"):
        load_config(tiny_cpu, [*SERVED, "judge.model_path=/models/judge", "judge.base_url=http://h/v1"])
    with pytest.raises(ConfigError, match=r"judge.model_path: empty, with judge.serve=true: name the judge model"):
        load_config(tiny_cpu, SERVED)
    with pytest.raises(ConfigError, match=r"or judge.serve=true to serve one itself"):
        load_config(tiny_cpu, [*SERVED, "judge.serve=false"])


def test_the_run_serves_its_judge_starts_it_again_where_it_died_and_stops_it(tmp_path, tiny_model_dir):
    from areal_pipeline.rewards.local_judge import served_judge_config
    from areal_pipeline.services import Services

    cfg = served_cfg(tmp_path, tiny_model_dir)
    services = Services(cfg, str(tiny_model_dir), tmp_path / "logs", tools=())
    try:
        started = services.start_tools()
        address = started["judge"]
        assert set(started) == {"judge"} and address.startswith("127.0.0.1:")
        judge_cfg = served_judge_config(cfg, address).judge
        assert judge_cfg.base_url == f"http://{address}/v1" and judge_cfg.model == "local-judge"
        assert ask(judge_cfg.base_url)["choices"][0]["message"]["role"] == "assistant"
        assert services.start_judge() == address  # running: the same server, nothing started
        first = services.judge.popen.pid

        os.killpg(first, signal.SIGKILL)
        services.judge.popen.wait(timeout=30)
        assert services.start_judge() == address  # died: started again where the judge reward asks
        assert services.judge.popen.pid != first
        assert ask(judge_cfg.base_url)["object"] == "chat.completion"
        assert (tmp_path / "logs" / "judge-server.log").stat().st_size > 0  # both lives' output, in the run's logs
        second = services.judge.popen
    finally:
        services.stop()
    assert second.poll() is not None and services.judge is None
    with pytest.raises(Exception, match="stopped"):
        services.start_judge()


def test_a_run_without_a_served_judge_starts_none(tmp_path, tiny_model_dir):
    from areal_pipeline.services import Services

    for more in (["judge.serve=false", "judge.base_url=http://127.0.0.1:1/v1", "judge.model=m"],
                 ['rollout.group_reward=""']):
        services = Services(served_cfg(tmp_path, tiny_model_dir, *more), str(tiny_model_dir), tmp_path, tools=())
        try:
            assert services.start_tools() == {} and services.start_judge() is None and services.judge is None
        finally:
            services.stop()


def test_rescoring_serves_the_runs_judge_for_its_block_only(tmp_path, tiny_model_dir):
    from areal_pipeline.rewards.local_judge import judge_served

    cfg = served_cfg(tmp_path, tiny_model_dir)
    with judge_served(cfg, tmp_path / "logs", needed=False) as same:
        assert same is cfg
    with judge_served(cfg, tmp_path / "logs", needed=True) as served:
        base_url = served.judge.base_url
        assert base_url != cfg.judge.base_url and ask(base_url)["choices"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            ask(base_url)
        except OSError:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the judge server at {base_url} still answers after the block")
