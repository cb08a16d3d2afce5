"""A judge the run serves itself (judge.serve, areal_pipeline/rewards/local_judge.py): the config's rules, the judge
server's life with the run's services (started, started again where it died, stopped), and re-scoring's own."""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
from pathlib import Path

import pytest

from areal_pipeline import auth
from areal_pipeline.config import ConfigError
from areal_pipeline.run_spec import load_config
from areal_pipeline.services import ServicesStoppedError

REPO = Path(__file__).resolve().parents[1]


def ask(base_url: str) -> dict:
    """One chat completion of the judge at `base_url`, as the judge reward asks it."""
    body = json.dumps({"model": "local-judge", "max_tokens": 4, "temperature": 0,
                       "messages": [{"role": "user", "content": "Question:\nWhat is 1+1?"}]}).encode()
    request = urllib.request.Request(base_url + "/chat/completions", body,
                                     {"Content-Type": "application/json", **auth.auth_headers()})
    with auth.opener().open(request, timeout=60) as reply:
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
    with pytest.raises(ServicesStoppedError, match="stopped"):
        services.start_judge()


def test_reading_the_judge_s_usage_starts_nothing_only_the_rollout_s_step_starts_the_judge(tmp_path, tiny_model_dir):
    """The figures a reader asks for (what the judge's calls cost) start no judge server, and do not start a dead
    one again; `start_group_reward`, the step the rollout takes before it judges, does both."""
    import psutil

    from areal_pipeline.pipeline import Pipeline

    def children() -> set[int]:
        return {p.pid for p in psutil.Process().children(recursive=True)}

    pipeline = Pipeline(served_cfg(tmp_path, tiny_model_dir, f"model.path={tiny_model_dir}"))
    try:
        before = children()
        assert pipeline.take_group_reward_usage() == {}
        assert pipeline.services.judge is None and children() == before
        judge = pipeline.start_group_reward()
        server = pipeline.services.judge
        assert judge.url == f"http://{server.address}/v1/chat/completions" and server.popen.poll() is None

        os.killpg(server.popen.pid, signal.SIGKILL)
        server.popen.wait(timeout=30)
        running = children()
        assert pipeline.take_group_reward_usage()["judge/calls"] == 0
        assert pipeline.services.judge is server and children() == running  # still dead: nothing started
        assert pipeline.start_group_reward() is judge  # the same judge, its server started again where it was
        assert pipeline.services.judge.address == server.address and pipeline.services.judge.popen.poll() is None
        assert ask(f"http://{server.address}/v1")["object"] == "chat.completion"
    finally:
        pipeline.close()
        pipeline.services.stop()


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


FIXED_SCORES = [1, 0]  # what the test's judge model answers every call: the first answer right, the second wrong


def fixed_answer_judge(directory: Path) -> Path:
    """A tiny Qwen2 taught to answer the judge's chat of the arithmetic task with FIXED_SCORES, whatever the
    candidates: a real model that the real server serves and the real judge reward parses, whose grades are known."""
    import random

    import torch
    from transformers import Qwen2ForCausalLM

    from areal_pipeline.config import DatasetConfig, TinyModelConfig
    from areal_pipeline.data.datasets import load_records
    from areal_pipeline.model import build_byte_tokenizer, tiny_qwen2_config
    from areal_pipeline.rewards.group import Candidate
    from areal_pipeline.rewards.judge import judge_messages

    tokenizer = build_byte_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_qwen2_config(tokenizer, TinyModelConfig(hidden_size=32, intermediate_size=64,
                                                                          num_hidden_layers=1)))
    answer = tokenizer(json.dumps({"scores": FIXED_SCORES}))["input_ids"] + [tokenizer.eos_token_id]
    records, rng = load_records(DatasetConfig(), "train", 1), random.Random(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(60):
        record = rng.choice(records)
        candidates = [Candidate(prompt_id="p", sample_idx=i, question=record["question"], answer=record["answer"],
                                completion=str(rng.randint(0, 40))) for i in range(len(FIXED_SCORES))]
        prompt = tokenizer.apply_chat_template(judge_messages(candidates), add_generation_prompt=True,
                                               tokenize=True, return_dict=False)
        ids = torch.tensor([list(prompt) + answer])
        labels = torch.tensor([[-100] * len(prompt) + answer])
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return directory


def test_a_run_serves_its_judge_the_rollout_asks_it_and_it_stops_with_the_run(tmp_path, tiny_model_dir):
    from areal_pipeline.data.shards import read_table
    from areal_pipeline.pipeline import run_plain

    judge_dir = fixed_answer_judge(tmp_path / "judge-model")
    cfg = load_config(str(REPO / "configs/tiny_cpu.yaml"), [
        f"output_dir={tmp_path}", "run_id=served", f"model.path={tiny_model_dir}", "total_iterations=1",
        "eval_freq=0", "rollout.batch_size=4", f"rollout.gconfig.n_samples={len(FIXED_SCORES)}",
        "rollout.gconfig.max_new_tokens=4", "dataset.arithmetic_train_size=32", "rollout.group_reward=judge",
        "judge.serve=true", f"judge.model_path={judge_dir}", "judge.max_tokens=24", "judge.retries=0"])
    [metrics] = run_plain(cfg)

    rows = read_table(tmp_path / "served" / "iter_1" / "rollout").to_pylist()
    assert len(rows) == 8
    for row in rows:  # every reward is the served judge's grade of its answer's place in the group
        assert row["reward"] == FIXED_SCORES[row["sample_idx"]], row
    assert metrics["judge/calls"] == 4 and metrics["judge/completion_tokens"] > 0
    log = tmp_path / "served" / "logs" / "judge-server.log"
    address = re.search(r"CPU inference server on http://(127\.0\.0\.1:\d+) \(model ([^)]+)\)", log.read_text())
    assert address.group(2) == str(judge_dir)
    with pytest.raises(OSError):  # stopped with the run
        ask(f"http://{address.group(1)}/v1")
