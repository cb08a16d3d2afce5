"""The LLM judge group reward (rewards/judge.py): strict parsing, the content-hash cache, retries and the outage,
against a real OpenAI-compatible HTTP server in a subprocess (tests/_judge_server.py)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from areal_pipeline.config.schema import JudgeConfig
from areal_pipeline.errors import is_transient
from areal_pipeline.rewards.group import Candidate
from areal_pipeline.rewards.judge import (Judge, JudgeAnswerError, JudgeRefused, JudgeUnavailable, default_limit_name,
                                          judge_messages, parse_scores)
from areal_pipeline.utils import find_free_port

SERVER = Path(__file__).resolve().parent / "_judge_server.py"


@contextlib.contextmanager
def judge_server(tmp_path: Path, *args: str, name: str = "judge", port: int = 0):
    """The judge endpoint on `port` (0: a free one): yields (base_url, the call log)."""
    port = port or find_free_port()
    log = tmp_path / f"{name}-calls.jsonl"
    log.touch()
    process = subprocess.Popen([sys.executable, str(SERVER), "--port", str(port), "--log", str(log), *args],
                               stdout=subprocess.DEVNULL, stderr=open(tmp_path / f"{name}.err", "w"))
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"the judge server did not start: {(tmp_path / f'{name}.err').read_text()}")
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/v1", log
    finally:
        process.terminate()
        process.wait(timeout=10)


def calls(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


def group(prompt: str, question: str, answer: str, completions: list[str]) -> list[Candidate]:
    return [Candidate(prompt_id=prompt, sample_idx=i, question=question, completion=c, answer=answer)
            for i, c in enumerate(completions)]


GROUPS = [group("p1", "What is 2+3?", "5", ["5", "6", "The answer is 5.", "4"]),
          group("p2", "What is 7+1?", "8", ["9", "8"])]


def config(base_url: str, **changes) -> JudgeConfig:
    return dataclasses.replace(JudgeConfig(base_url=base_url, model="grader", retry_delay=0.05, timeout=10),
                               **changes)


def score_all(judge: Judge, groups=GROUPS) -> list[list[float]]:
    async def run():
        return [await judge.score_group(g) for g in groups]
    return asyncio.run(run())


def test_parse_scores_takes_exactly_n_numbers_in_0_1():
    assert parse_scores('{"scores": [1, 0, 0.5]}', 3) == [1.0, 0.0, 0.5]
    assert parse_scores('```json\n{"scores": [0.25]}\n```', 1) == [0.25]


@pytest.mark.parametrize("text, words", [
    ('{"scores": [1, 0]}', "2 scores for 3"), ('{"scores": [1, "0", 1]}', "not a number"),
    ('{"scores": [1, true, 1]}', "not a number"), ('{"scores": [1, 1.5, 0]}', "outside [0, 1]"),
    ('{"scores": [1, -0.1, 0]}', "outside [0, 1]"), ("[1, 0, 1]", "no {\"scores\""),
    ("the first is right", "not JSON"), ('{"scores": [1, NaN, 0]}', "not a number")])
def test_parse_scores_refuses_what_is_not_n_scores(text, words):
    with pytest.raises(JudgeAnswerError, match=words.replace("[", r"\[").replace("{", r"\{")):
        parse_scores(text, 3)


def test_the_prompt_shows_the_question_the_reference_and_every_candidate():
    user = judge_messages(GROUPS[0])[1]["content"]
    assert "What is 2+3?" in user and "Reference answer:\n5" in user
    assert all(f"Candidate {i}:\n{c.completion}" in user for i, c in enumerate(GROUPS[0], 1))
    assert "Reference answer" not in judge_messages(GROUPS[0], include_reference=False)[1]["content"]
    assert default_limit_name("https://api.example.com:8443/v1") == "judge-api.example.com"


def test_scores_come_from_the_judge_and_a_rerun_asks_again_for_nothing(tmp_path):
    with judge_server(tmp_path) as (base_url, log):
        cfg = config(base_url, prompt_price_per_mtok=2.0, completion_price_per_mtok=10.0)
        first = Judge(cfg, tmp_path / "cache")
        assert score_all(first) == [[1.0, 0.0, 1.0, 0.0], [0.0, 1.0]]
        usage = first.take_usage()
        made = calls(log)
        assert len(made) == 2 and usage["judge/calls"] == 2 and usage["judge/cache_hits"] == 0
        assert usage["judge/prompt_tokens"] > 0 and usage["judge/completion_tokens"] > 0
        assert usage["judge/cost_usd"] == pytest.approx(
            (usage["judge/prompt_tokens"] * 2.0 + usage["judge/completion_tokens"] * 10.0) / 1e6)
        assert first.take_usage()["judge/calls"] == 0  # taken: the next take counts from here

        rerun = Judge(cfg, tmp_path / "cache")  # another run (or a retried node) on the same output dir
        assert score_all(rerun) == [[1.0, 0.0, 1.0, 0.0], [0.0, 1.0]]
        assert len(calls(log)) == 2
        assert rerun.take_usage() == {"judge/calls": 0, "judge/cache_hits": 2, "judge/prompt_tokens": 0,
                                      "judge/completion_tokens": 0, "judge/cost_usd": 0.0}

        other = Judge(config(base_url, temperature=0.5), tmp_path / "cache")  # other sampling: another question
        score_all(other, GROUPS[:1])
        assert len(calls(log)) == 3


def test_transient_errors_are_retried_honouring_retry_after(tmp_path):
    with judge_server(tmp_path, "--fail-first", "2", "--status", "429", "--retry-after", "0.5") as (base_url, log):
        judge = Judge(config(base_url), tmp_path / "cache")
        assert score_all(judge, GROUPS[:1]) == [[1.0, 0.0, 1.0, 0.0]]
        made = calls(log)
        assert [c["status"] for c in made] == [429, 429, 200]
        assert made[1]["start"] - made[0]["end"] >= 0.45 and made[2]["start"] - made[1]["end"] >= 0.45
        assert judge.take_usage()["judge/calls"] == 1


def test_answers_that_are_no_scores_are_retried_then_a_clear_transient_error(tmp_path):
    with judge_server(tmp_path, "--garbage") as (base_url, log):
        judge = Judge(config(base_url, retries=2), tmp_path / "cache")
        with pytest.raises(JudgeUnavailable, match=r"gave no valid answer in 3 attempt\(s\).*not JSON") as error:
            score_all(judge, GROUPS[:1])
        assert base_url in str(error.value) and is_transient(error.value)
        assert len(calls(log)) == 3
        assert not list((tmp_path / "cache").rglob("*.json"))  # nothing made up, nothing cached


def test_a_judge_that_is_down_is_retried_then_a_clear_transient_error(tmp_path):
    with socket.socket() as down:  # bound, never listening: it refuses connections, and no other server takes it
        down.bind(("127.0.0.1", 0))
        base_url = f"http://127.0.0.1:{down.getsockname()[1]}/v1"
        judge = Judge(config(base_url, retries=2), tmp_path / "cache")
        started = time.monotonic()
        with pytest.raises(JudgeUnavailable, match=r"3 attempt\(s\); the last: ConnectionError") as error:
            score_all(judge, GROUPS[:1])
    assert base_url in str(error.value) and is_transient(error.value)
    assert time.monotonic() - started >= 0.05 + 0.1  # the backoff between the attempts


def test_a_refused_request_is_not_retried(tmp_path):
    with judge_server(tmp_path, "--api-key", "right") as (base_url, log):
        judge = Judge(config(base_url), tmp_path / "cache", api_key="wrong")
        with pytest.raises(JudgeRefused, match="refused the request: HTTP 401") as error:
            score_all(judge, GROUPS[:1])
        assert not is_transient(error.value)  # the node is not retried for a wrong key
        assert len(calls(log)) == 1
        judge = Judge(config(base_url), tmp_path / "cache", api_key="right")
        assert score_all(judge, GROUPS[:1]) == [[1.0, 0.0, 1.0, 0.0]]


def test_the_local_limit_keeps_calls_within_max_concurrency(tmp_path):
    with judge_server(tmp_path, "--delay", "0.2") as (base_url, log):
        judge = Judge(config(base_url, max_concurrency=1), tmp_path / "cache")
        groups = [group(f"p{i}", f"What is {i}+1?", str(i + 1), [str(i + 1), "0"]) for i in range(4)]

        async def run():
            return await asyncio.gather(*(judge.score_group(g) for g in groups))
        assert asyncio.run(run()) == [[1.0, 0.0]] * 4
        assert_no_overlap(calls(log))


def assert_no_overlap(made: list[dict]) -> None:
    spans = sorted((c["start"], c["end"]) for c in made)
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:])), spans


# ----- runs: the rollout scores its groups with the judge, under Prefect ----------------------------------------------

def run_overrides(tmp_path: Path, model_dir: Path, run_id: str, base_url: str, limit: str) -> list[str]:
    return [f"output_dir={tmp_path}", f"run_id={run_id}", f"model.path={model_dir}", "total_iterations=1",
            "rollout.batch_size=4", "rollout.gconfig.n_samples=2", "rollout.gconfig.max_new_tokens=4",
            "eval_freq=0", "dataset.arithmetic_train_size=32", "rollout.group_reward=judge",
            f"judge.base_url={base_url}", "judge.model=grader", f"judge.limit_name={limit}",
            "judge.max_concurrency=1", "judge.retries=1", "judge.retry_delay=0.05",
            "judge.prompt_price_per_mtok=1.0", "judge.completion_price_per_mtok=4.0"]


def train(overrides: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "cli", "train", "--config", "configs/tiny_cpu.yaml", *overrides],
                            cwd=Path(__file__).resolve().parents[1], env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)


def judged_rows(run_dir: Path) -> list[dict]:
    from areal_pipeline.data.shards import read_table

    return read_table(run_dir / "iter_1" / "rollout").to_pylist()


def assert_judged(run_dir: Path) -> dict:
    """The run's rewards are the judge's grades of its answers (1 where the answer holds the reference), the
    workflow's own kept beside them, and its metrics carry the judge's usage."""
    from areal_pipeline.rewards.math import math_reward

    rows = judged_rows(run_dir)
    assert len(rows) == 8
    workflow_rewards = []
    for row in rows:
        meta = json.loads(row["metadata"])
        # the workflow's own reward (rlvr's verifier on the answer), kept beside the judge's
        assert meta["workflow_reward"] == math_reward(row["text"], meta["answer"]), row
        workflow_rewards.append(meta["workflow_reward"])
        assert row["reward"] == (1.0 if str(meta["answer"]) in row["text"] else 0.0), row
    metrics = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    # ... and averaged as the metric docs/judge.md promises
    assert metrics["agent/workflow_reward"] == pytest.approx(sum(workflow_rewards) / len(workflow_rewards))
    assert metrics["judge/calls"] + metrics["judge/cache_hits"] == 4
    assert metrics["judge/prompt_tokens"] > 0 and metrics["judge/cost_usd"] == pytest.approx(
        (metrics["judge/prompt_tokens"] * 1.0 + metrics["judge/completion_tokens"] * 4.0) / 1e6)
    return metrics


def test_two_concurrent_runs_share_one_prefect_limit_on_the_judge(prefect_api, tiny_model_dir, tmp_path):
    import os
    import uuid

    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    limit = f"judge-test-{uuid.uuid4().hex[:8]}"
    # a slow judge: the two runs' rollouts end close together, so calls not held back by the shared limit overlap
    with judge_server(tmp_path, "--delay", "1.0") as (base_url, log):
        # seeds of their own: their groups differ, so neither finds the other's in the shared cache
        runs = [train([*run_overrides(tmp_path, tiny_model_dir, f"j{i}", base_url, limit), f"seed={i + 1}"], env,
                      tmp_path / f"j{i}.log") for i in range(2)]
        for i, run in enumerate(runs):
            assert run.wait(timeout=600) == 0, (tmp_path / f"j{i}.log").read_text()[-3000:]
        made = calls(log)
        assert len(made) == 8 and {c["status"] for c in made} == {200}
        assert_no_overlap(made)  # one slot between both runs: never two calls at once
        for i in range(2):
            metrics = assert_judged(tmp_path / f"j{i}")
            assert metrics["judge/calls"] == 4
    from prefect.client.orchestration import get_client

    async def slots():
        async with get_client() as client:
            return (await client.read_global_concurrency_limit_by_name(limit)).limit
    assert asyncio.run(slots()) == 1


async def rollout_task_run(run_id: str):
    """The rollout node of iteration 1 of run `run_id` (its task run), or None before it starts."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName, TaskRunFilter, TaskRunFilterName

    async with get_client() as client:
        runs = await client.read_task_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[f"{run_id}/iter-1"])),
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=["rollout-1"])))
    return runs[0] if runs else None


@pytest.mark.parametrize("eta", [0, 1], ids=["sync", "async"])
def test_a_judge_outage_fails_the_rollout_node_clearly_and_its_prefect_retry_scores_the_groups(
        prefect_api, tiny_model_dir, tmp_path, eta):
    import os
    import uuid

    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    # down until the rollout node has failed once: a port held bound but not listening refuses connections, and no
    # other test's server can take it meanwhile (one did, and its 401 reached the run in place of the judge's scores)
    placeholder = socket.socket()
    placeholder.bind(("127.0.0.1", 0))
    port = placeholder.getsockname()[1]
    base_url = f"http://127.0.0.1:{port}/v1"
    run_id = f"outage-{uuid.uuid4().hex[:6]}"
    log = tmp_path / "out.log"
    run = train([*run_overrides(tmp_path, tiny_model_dir, run_id, base_url, f"judge-test-{uuid.uuid4().hex[:8]}"),
                 f"rollout.max_head_offpolicyness={eta}"], env, log)
    try:
        deadline = time.monotonic() + 300
        while True:  # until Prefect holds the failed node for its retry (rollout's first retry: 5 s later)
            node = asyncio.run(rollout_task_run(run_id))
            if node is not None and node.state is not None and node.state.name == "AwaitingRetry":
                break
            assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        assert not (tmp_path / run_id / "iter_1" / "rollout" / "manifest.json").exists()
        placeholder.close()
        with judge_server(tmp_path, port=port) as (_, calls_log):  # the judge is back for the node's retry
            assert run.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        placeholder.close()
        if run.poll() is None:
            run.kill()
            run.wait()
    out = log.read_text()
    assert f"judge at {base_url}/chat/completions: attempt 1 of 2 failed (ConnectionError" in out
    # the groups played before the judge failed were journaled unjudged: the retry judged them, played none again
    resumed = re.search(r"iteration 1: (\d) group\(s\) on disk await the group reward's scores", out)
    assert resumed and int(resumed.group(1)) >= 1, out[-3000:]
    deadline = time.monotonic() + 60  # task run states reach the API through its events: a moment later
    while not ((node := asyncio.run(rollout_task_run(run_id))) is not None and node.state is not None
               and node.state.is_completed()):
        assert time.monotonic() < deadline, node and node.state
        time.sleep(0.2)
    # failed while the judge was down, then completed by a retry: the first (5 s later) or, where the judge server
    # took longer than that to start on a loaded machine, the second
    assert node.run_count in (2, 3)
    assert len(calls(calls_log)) == 4
    metrics = assert_judged(tmp_path / run_id)  # every reward is the judge's: none is a 0 for the outage
    assert metrics["judge/calls"] == 4


def test_a_judge_reward_needs_an_endpoint_and_a_model_and_one_reward_per_trajectory():
    from areal_pipeline.config import ConfigError
    from areal_pipeline.run_spec import load_config

    with pytest.raises(ConfigError, match=r"judge.base_url: empty, with rollout.group_reward=judge"):
        load_config("configs/tiny_cpu.yaml", ["rollout.group_reward=judge", "judge.model=m"])
    with pytest.raises(ConfigError, match=r"judge.model: empty"):
        load_config("configs/tiny_cpu.yaml", ["rollout.group_reward=judge", "judge.base_url=http://127.0.0.1:1/v1"])
    with pytest.raises(ConfigError, match=r"judge.api_key_env='sk-123': must be empty or an environment variable"):
        load_config("configs/tiny_cpu.yaml", ["judge.api_key_env=sk-123"])
    with pytest.raises(ConfigError, match=r"per-turn returns"):
        load_config("configs/tiny_cpu.yaml", ["rollout.group_reward=judge", "judge.base_url=http://h/v1",
                                              "judge.model=m", "rollout.workflow=multi_turn"])
    with pytest.raises(ConfigError, match=r"rollout.group_reward=judge: ReMax's baseline episode"):
        load_config("configs/tiny_cpu.yaml", ["rollout.group_reward=judge", "judge.base_url=http://h/v1",
                                              "judge.model=m", "ppo.advantage=remax", "ppo.loss=reinforce"])
    cfg = load_config("configs/tiny_cpu.yaml", ["rollout.group_reward=judge", "judge.base_url=http://h/v1",
                                                "judge.model=m", "judge.api_key_env=JUDGE_KEY"])
    assert cfg.judge.api_key_env == "JUDGE_KEY"
