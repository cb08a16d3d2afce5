"""The failure policy of episodes (rollout/failures.py, group.play_group): retries with the same seed, the
outcomes drop | mask | refill | fail, their counts, and real faults: a reward worker SIGKILLed mid-score, a reward
that hangs, the BM25 retrieval server killed and restarted mid-rollout."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
from pebble import ProcessExpired
from test_workflows_common import ScriptedEngine

from areal_pipeline.config import ConfigError, GenerationConfig
from areal_pipeline.data.shards import read_trajectories
from areal_pipeline.data.trajectory import Trajectory
from areal_pipeline.inference.client import InferenceServerError
from areal_pipeline.inference.types import ModelRequest, SamplingParams
from areal_pipeline.rewards.pool import (RewardCrash, RewardError, RewardLoadError, RewardPool, RewardReference,
                                         RewardTimeout)
from areal_pipeline.rollout.executor import episode_seed, play_batch, refill_prompt, rollout_stats, select_batch
from areal_pipeline.rollout.failures import (EpisodeFailure, EpisodesFailed, FailurePolicy, GroupResult,
                                             RolloutFailureRate, check_failure_rate, classify, failure_records,
                                             failure_stats)
from areal_pipeline.rollout.group import play_group, run_group
from areal_pipeline.tools.retrieval_client import RetrievalError
from areal_pipeline.utils import DeadlineExceeded, PeerTimeout
from areal_pipeline.workflows.openai_agent import AgentError

SERVER = "127.0.0.1:30001"
FAST = dict(episode_retry_delay=0.01, episode_timeout=0.0)


class SeededEngine:
    """Answers a request with tokens that are a function of its seed (a sampler that honours `sampling_seed`)."""

    def __init__(self):
        self.seeds: list = []

    async def agenerate_group(self, reqs):
        from areal_pipeline.inference.types import ModelResponse

        out = []
        for r in reqs:
            self.seeds.append((r.rid, r.sampling.sampling_seed))
            tokens = [(r.sampling.sampling_seed or 0) % 97 + 3, 5]
            out.append(ModelResponse(input_tokens=list(r.input_ids), output_tokens=tokens, output_logprobs=[-1.0, -2.0],
                                     output_versions=[0, 0], stop_reason="stop", latency=0.0))
        return out


class Flaky:
    """A workflow whose episode (prompt, sample) fails its first `fails[(prompt, sample)]` attempts with `error()`,
    recording each attempt's seed; its trajectory's tokens come from the engine, so from the seed."""

    def __init__(self, fails=None, error=lambda: InferenceServerError(SERVER, "/generate", "HTTP 503", status=503),
                 sleep=None):
        self.fails, self.error, self.sleep = dict(fails or {}), error, sleep or {}
        self.attempts: list[tuple] = []

    async def arun_episode(self, engine, data):
        key = (data["prompt_id"], data["sample_idx"])
        self.attempts.append((*key, data.get("sampling_seed")))
        resp = await engine.agenerate(ModelRequest(rid=f"{key[0]}/{key[1]}/{len(self.attempts)}", input_ids=[1, 2],
                                                   sampling=SamplingParams(sampling_seed=data.get("sampling_seed"))))
        if self.sleep.get(key):
            await asyncio.sleep(self.sleep.pop(key))
        if self.fails.get(key, 0) > 0:
            self.fails[key] -= 1
            raise self.error()
        return Trajectory(prompt_id=data["prompt_id"], group_id="?", sample_idx=-1,
                          input_ids=[1, 2, *resp.output_tokens], loss_mask=[0, 0, 1, 1], logprobs=[0, 0, -1, -2],
                          versions=[-1, -1, 0, 0], reward=float(resp.output_tokens[0] % 2))


def _rows(trajectories):
    return [(t.group_id, t.sample_idx, t.input_ids, t.reward) for t in trajectories]


def _group(workflow, data, n=3, policy=FailurePolicy(**FAST), **kwargs):
    return asyncio.run(play_group(workflow, SeededEngine(), data, n, slot=kwargs.pop("slot", 0), policy=policy,
                                  **kwargs))


def test_a_retried_episode_plays_again_with_the_same_seed_and_makes_the_undisturbed_trajectories():
    data = {"prompt_id": "a", "sampling_seed": 1234}
    reference = _group(Flaky(), data)
    recovered = []

    async def recover():
        recovered.append(time.monotonic())

    flaky = Flaky(fails={("a", 1): 2})
    policy = FailurePolicy(episode_retries=2, episode_retry_delay=0.1, episode_timeout=0)
    start = time.monotonic()
    result = _group(flaky, data, policy=policy, recover=recover)
    assert time.monotonic() - start >= 0.1 + 0.2  # the delay doubles
    assert (result.outcome, result.failures, result.episodes) == ("ok", [], 3)
    assert _rows(result.trajectories) == _rows(reference.trajectories)
    seeds = [seed for pid, i, seed in flaky.attempts if i == 1]
    assert len(seeds) == 3 and len(set(seeds)) == 1  # three attempts of sample 1, one seed
    assert [(f.cause, f.peer, f.sample_idx, f.attempt, f.prompt_id) for f in result.retried] == [
        ("inference", SERVER, 1, 1, "a"), ("inference", SERVER, 1, 2, "a")]
    assert len(recovered) == 2  # before each retry of an inference failure
    # the siblings were not cancelled: each played exactly once
    assert sorted(i for _, i, _ in flaky.attempts) == [0, 1, 1, 1, 2]
    stats = failure_stats([result])
    assert stats == {"failure_rate": 0.0, "groups_dropped": 0, "groups_refilled": 0, "episodes_masked": 0,
                     "retries/inference": 2}


def _agent_bug():
    try:
        raise ValueError("the agent's own bug")
    except ValueError as bug:
        try:
            raise AgentError("agent x failed") from bug
        except AgentError as wrapped:
            return wrapped


@pytest.mark.parametrize("error, cause", [
    (lambda: InferenceServerError(SERVER, "/generate", "prompt too long", status=400), "inference_refused"),
    (_agent_bug, "agent"),
    (lambda: RewardError(len, ("x",), "ValueError('bad')"), "reward_error"),
])
def test_a_failure_no_retry_can_pass_is_played_once(error, cause):
    flaky = Flaky(fails={("a", 0): 5}, error=error)
    result = _group(flaky, {"prompt_id": "a"}, policy=FailurePolicy(episode_retries=3, **FAST))
    assert [i for _, i, _ in flaky.attempts].count(0) == 1
    assert result.outcome == "dropped" and result.trajectories == [] and result.retried == []
    [failure] = result.failures
    assert (failure.cause, failure.retryable, failure.attempt) == (cause, False, 1)


class _Expired(ProcessExpired):
    def __init__(self):
        super().__init__("Abnormal termination", code=-9, pid=4321)


@pytest.mark.parametrize("error, expected", [
    (InferenceServerError(SERVER, "/generate", "boom", status=503), ("inference", True, SERVER)),
    (InferenceServerError(SERVER, "/generate", "unreachable", status=None), ("inference", True, SERVER)),
    (InferenceServerError(SERVER, "/generate", "too long", status=400), ("inference_refused", False, SERVER)),
    (InferenceServerError(SERVER, "/generate", "busy", status=429), ("inference", True, SERVER)),
    # a server restarted on its base refuses the run's LoRA adapter (SGLang's words) until recovery pushes it
    (InferenceServerError(SERVER, "/generate", "HTTP 400: The following requested LoRA adapters are not loaded: "
                          "policy-v3\nLoaded adapters: [].", status=400), ("inference", True, SERVER)),
    (RetrievalError("retrieval server 127.0.0.1:8123: HTTP 503: x", "127.0.0.1:8123", 503),
     ("retrieval", True, "127.0.0.1:8123")),
    (RetrievalError("retrieval server 127.0.0.1:8123: HTTP 422: x", "127.0.0.1:8123", 422),
     ("retrieval", False, "127.0.0.1:8123")),
    (RewardTimeout(len, ("x",), 5.0), ("reward_timeout", True, "reward builtins.len")),
    (RewardCrash(len, _Expired()), ("reward_crash", True, "reward worker pid 4321")),
    (RewardError(len, ("x",), "ValueError('bad')"), ("reward_error", False, "reward builtins.len")),
    (AgentError("agent failed"), ("agent", True, None)),
    (RuntimeError("a workflow's own error"), ("agent", True, None)),
    (KeyError("answer"), ("agent", False, None)),
    (PeerTimeout("trainer rank 1", "reply", 600), ("agent", True, "trainer rank 1")),
])
def test_classify_names_the_cause_the_peer_and_whether_a_retry_may_pass(error, expected):
    failure = classify(error)
    assert (failure.cause, failure.retryable, failure.peer) == expected
    assert type(error).__name__ in failure.message


@pytest.mark.parametrize("error", [DeadlineExceeded("node deadline"), ConfigError("x: bad"), RewardLoadError("no"),
                                   TypeError("returned dict"), asyncio.CancelledError(), KeyboardInterrupt()])
def test_classify_leaves_what_is_no_episodes_fault_to_fail_the_node(error):
    assert classify(error) is None


def test_an_error_that_is_no_episodes_fault_fails_the_group_as_itself_and_cancels_the_siblings():
    flaky = Flaky(fails={("a", 0): 1}, error=lambda: TypeError("returned dict"), sleep={("a", 1): 900, ("a", 2): 900})
    start = time.monotonic()
    with pytest.raises(TypeError, match="returned dict"):
        _group(flaky, {"prompt_id": "a"})
    assert time.monotonic() - start < 120  # the siblings were cancelled: waiting for them takes 900 s


def _failing_batch(on_failure, fails, n=3, refill=None, **policy):
    workflow = Flaky(fails=fails)
    slots = {0: {"prompt_id": "a", "sampling_seed": 1}, 1: {"prompt_id": "b", "sampling_seed": 2}}
    seen = []
    groups = asyncio.run(play_batch(workflow, SeededEngine(), slots, max_concurrent_rollouts=8, n_samples=n,
                                    policy=FailurePolicy(on_failure=on_failure, episode_retries=0, **FAST, **policy),
                                    refill=refill, on_group=seen.append, progress=False))
    assert sorted(g.slot for g in seen) == [0, 1] and [g.slot for g in groups] == [0, 1]
    return groups


def test_drop_leaves_the_group_out_and_counts_it():
    ok, dropped = _failing_batch("drop", {("b", 1): 1})
    assert (ok.outcome, dropped.outcome, dropped.trajectories) == ("ok", "dropped", [])
    assert [(t.group_id, t.sample_idx) for t in ok.trajectories] == [("a", 0), ("a", 1), ("a", 2)]
    assert failure_stats([ok, dropped]) == {"failure_rate": 1 / 6, "groups_dropped": 1, "groups_refilled": 0,
                                            "episodes_masked": 0, "failures/inference": 1}
    assert failure_records([ok, dropped]) == [{"slot": 1, "prompt_id": "b", "sample_idx": 1, "cause": "inference",
                                               "peer": SERVER, "attempt": 1,
                                               "message": f"InferenceServerError: inference server {SERVER}/generate: "
                                                          "HTTP 503"}]


def test_mask_keeps_the_survivors_with_their_sample_index_or_drops_a_group_with_too_few():
    ok, masked = _failing_batch("mask", {("b", 1): 1}, min_group_survivors=2)
    assert masked.outcome == "masked"
    assert [(t.group_id, t.sample_idx) for t in masked.trajectories] == [("b", 0), ("b", 2)]
    assert failure_stats([ok, masked])["episodes_masked"] == 1
    _, dropped = _failing_batch("mask", {("b", 1): 1, ("b", 2): 1}, min_group_survivors=2)
    assert (dropped.outcome, len(dropped.failures)) == ("dropped", 2)
    assert failure_stats([ok, dropped])["failure_rate"] == 2 / 6


def test_refill_replaces_the_group_by_a_reserve_prompt_and_keeps_the_original_failures():
    asked = []

    def refill(slot, j):
        asked.append((slot, j))
        return {"prompt_id": f"reserve-{slot}-{j}", "sampling_seed": 99 + j}

    ok, refilled = _failing_batch("refill", {("b", 0): 1}, refill=refill)
    assert (ok.outcome, refilled.outcome) == ("ok", "refilled")
    assert (refilled.prompt_id, refilled.replaced_prompt_id) == ("reserve-1-0", "b")
    assert [(t.group_id, t.sample_idx) for t in refilled.trajectories] == [("reserve-1-0", i) for i in range(3)]
    assert [(f.prompt_id, f.cause) for f in refilled.failures] == [("b", "inference")]
    assert asked == [(1, 0)]
    assert failure_stats([ok, refilled]) == {"failure_rate": 1 / 9, "groups_dropped": 0, "groups_refilled": 1,
                                             "episodes_masked": 0, "failures/inference": 1}
    assert failure_records([refilled])[0]["prompt_id"] == "b"


def test_refill_tries_further_reserves_then_drops():
    def refill(slot, j):
        return {"prompt_id": "b", "sampling_seed": j}  # a reserve that fails as well (the same prompt id fails)

    workflow = Flaky(fails={("b", 0): 10})
    result = asyncio.run(play_group(workflow, SeededEngine(), {"prompt_id": "b"}, 2, slot=3, refill=refill,
                                    policy=FailurePolicy(on_failure="refill", episode_retries=0, **FAST)))
    assert (result.outcome, result.prompt_id, len(result.failures), result.episodes) == ("dropped", "b", 4, 8)


def test_refill_without_reserves_to_take_is_an_error_not_a_drop():
    with pytest.raises(ValueError, match="rollout.on_failure=refill: the rollout passes no refill"):
        _group(Flaky(), {"prompt_id": "a"}, policy=FailurePolicy(on_failure="refill", **FAST))


def test_fail_raises_naming_the_cause_and_the_peer():
    with pytest.raises(EpisodesFailed, match=rf"prompt b \(slot 1\), sample 1: inference 1 @{SERVER} .*HTTP 503"):
        _failing_batch("fail", {("b", 1): 1})


def test_a_baseline_episode_that_fails_for_good_drops_its_group():
    baseline = Flaky(fails={("a", 2): 5})
    result = asyncio.run(play_group(Flaky(), SeededEngine(), {"prompt_id": "a", "sampling_seed": 3}, 2, baseline,
                                    slot=0, policy=FailurePolicy(on_failure="mask", episode_retries=1, **FAST)))
    assert (result.outcome, [(f.sample_idx, f.attempt) for f in result.failures]) == ("dropped", [(2, 2)])
    ok = asyncio.run(play_group(Flaky(), SeededEngine(), {"prompt_id": "a", "sampling_seed": 3}, 2,
                                Flaky(fails={("a", 2): 1}), slot=0, policy=FailurePolicy(episode_retries=1, **FAST)))
    assert ok.outcome == "ok" and all(t.baseline_reward is not None for t in ok.trajectories)


def test_an_attempt_past_episode_timeout_is_retried():
    flaky = Flaky(sleep={("a", 0): 900})
    policy = FailurePolicy(episode_retries=1, episode_retry_delay=0.01, episode_timeout=0.5)
    start = time.monotonic()
    result = _group(flaky, {"prompt_id": "a", "sampling_seed": 5}, n=2, policy=policy)
    assert time.monotonic() - start < 120  # cut at the timeout: the attempt itself would take 900 s
    assert result.outcome == "ok" and len(result.trajectories) == 2
    [failure] = result.retried
    assert (failure.cause, failure.sample_idx, failure.retryable) == ("episode_timeout", 0, True)
    assert "rollout.episode_timeout=0.5 s" in failure.message


def test_a_timeout_inside_the_episode_is_its_own_cause_not_episode_timeout():
    flaky = Flaky(fails={("a", 0): 1}, error=lambda: RewardTimeout(len, ("x",), 5.0))
    result = _group(flaky, {"prompt_id": "a"}, n=1, policy=FailurePolicy(episode_retries=1, episode_retry_delay=0.01,
                                                                           episode_timeout=60))
    assert [f.cause for f in result.retried] == ["reward_timeout"] and result.outcome == "ok"


def test_refill_prompt_is_pure_and_never_takes_a_prompt_of_its_own_batch():
    records = [{"prompt_id": f"p{i}", "x": i} for i in range(20)]
    batch = {r["prompt_id"] for r in select_batch(records, 2, 4, seed=7)}  # iteration 3's prompts
    reserves = [refill_prompt(records, 7, 3, slot, j, 4) for slot in range(4) for j in range(3)]
    assert reserves == [refill_prompt(records, 7, 3, slot, j, 4) for slot in range(4) for j in range(3)]
    assert not batch & {r["prompt_id"] for r in reserves}
    assert len({r["prompt_id"] for r in reserves}) == 12  # 16 prompts left over: distinct reserves
    first = reserves[0]
    assert first["sampling_seed"] == episode_seed(7, 3, f"refill/0/0/{first['prompt_id']}")
    assert first["x"] == int(first["prompt_id"][1:])
    assert refill_prompt(records, 7, 4, 0, 0, 4)["sampling_seed"] != first["sampling_seed"]
    with pytest.raises(ValueError, match="none is left to refill"):
        refill_prompt(records[:4], 7, 1, 0, 0, 4)
    with pytest.raises(ValueError, match="slot 4"):
        refill_prompt(records, 7, 1, 4, 0, 4)


def _failed(cause, peer, message, n, slot):
    return GroupResult(slot, f"p{slot}", [], [EpisodeFailure(cause, True, message, peer, sample_idx=i)
                                              for i in range(n)], outcome="dropped", episodes=8)


def test_past_max_failure_rate_the_node_fails_naming_causes_and_peers():
    groups = [_failed("retrieval", "127.0.0.1:8123", "RetrievalError: HTTP 503 Service Unavailable", 5, 0),
              _failed("agent", None, "AgentError: x", 2, 1),
              *[GroupResult(slot, f"p{slot}", [], episodes=8) for slot in range(2, 8)]]
    with pytest.raises(RolloutFailureRate, match=r"^iteration 4: 7/64 episodes failed: retrieval 5 @127\.0\.0\.1:8123 "
                                                 r"'RetrievalError: HTTP 503 Service Unavailable', agent 2 "):
        check_failure_rate(4, groups, FailurePolicy(max_failure_rate=0.1))
    check_failure_rate(4, groups, FailurePolicy(max_failure_rate=0.2))  # 7/64 is within 0.2


def _finish(groups, out, rows_per_shard=4):
    """The groups as the rollout node writes them (journal.finish_rollout), whatever their failure rate."""
    from areal_pipeline.rollout.journal import EpisodeJournal, finish_rollout

    journal = EpisodeJournal(out.parent / "rollout.episodes", run_id="r", iteration=1, batch_size=len(groups),
                             digest="d")
    return finish_rollout(groups, out, journal, policy=FailurePolicy(max_failure_rate=1.0), seconds=1.0,
                          rows_per_shard=rows_per_shard)


def test_rollout_stats_and_the_manifest_carry_the_failures(tmp_path):
    ok, dropped = _failing_batch("drop", {("b", 1): 1})
    stats = rollout_stats(ok.trajectories, 1.0, [ok, dropped])
    assert (stats["num_trajectories"], stats["failure_rate"], stats["failures/inference"]) == (3, 1 / 6, 1)
    assert "failure_rate" not in rollout_stats(ok.trajectories, 1.0)
    manifest = _finish([ok, dropped], tmp_path / "rollout", rows_per_shard=2)
    assert manifest["failures"] == failure_records([ok, dropped])
    assert manifest["stats"]["groups_dropped"] == 1
    assert [t.group_id for t in read_trajectories(tmp_path / "rollout")] == ["a"] * 3


# ----- real processes ------------------------------------------------------------------------------------------

KILL_ONCE = '''
import os, time

def reward(completion, answer):
    """The first call writes its worker's pid and hangs (the test SIGKILLs it); later calls score."""
    try:
        fd = os.open(os.path.join(os.path.dirname(__file__), "killed"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return len(completion) / 100 + (answer in completion)
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    time.sleep(60)

def hang(completion, answer):
    time.sleep(900)
'''


def _rlvr(tokenizer, pool, reward):
    from areal_pipeline.workflows.rlvr import RLVRWorkflow

    return RLVRWorkflow(reward, GenerationConfig(n_samples=2, max_new_tokens=8), tokenizer, pool)


def _scripted(tokenizer):
    return ScriptedEngine(lambda req, turn: tokenizer.encode(f" {req.sampling.sampling_seed % 1000} 7",
                                                             add_special_tokens=False))


DATA = {"prompt_id": "q", "answer": "7", "sampling_seed": 4242, "messages": [{"role": "user", "content": "3+4?"}]}


def test_a_reward_worker_killed_mid_score_is_retried_and_scores_as_undisturbed(tiny_model_dir, tmp_path):
    from areal_pipeline.model import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    (tmp_path / "kill_once.py").write_text(KILL_ONCE)
    reward = RewardReference(f"{tmp_path}/kill_once.py:reward")
    policy = FailurePolicy(episode_retries=2, episode_retry_delay=0.1, episode_timeout=120)
    with RewardPool(max_workers=2, timeout=30) as pool:
        workflow = _rlvr(tokenizer, pool, reward)

        async def disturbed():
            playing = asyncio.ensure_future(play_group(workflow, _scripted(tokenizer), DATA, 2, slot=0, policy=policy))
            deadline = time.monotonic() + 60
            while not (tmp_path / "killed").exists() or not (tmp_path / "killed").read_text():
                assert time.monotonic() < deadline, "no reward call started"
                await asyncio.sleep(0.05)
            os.kill(int((tmp_path / "killed").read_text()), signal.SIGKILL)
            return await playing

        result = asyncio.run(disturbed())
        reference = asyncio.run(run_group(workflow, _scripted(tokenizer), DATA, 2))  # the marker is there: no kill
    assert result.outcome == "ok"
    [crash] = result.retried
    assert (crash.cause, crash.peer) == ("reward_crash", f"reward worker pid {(tmp_path / 'killed').read_text()}")
    assert _rows(result.trajectories) == _rows(reference)
    assert all(t.reward > 1 for t in result.trajectories)  # scored, and the answer 7 found: no 0.0


def test_a_hanging_reward_is_a_reward_timeout_never_a_zero(tiny_model_dir, tmp_path):
    from areal_pipeline.model import load_tokenizer

    tokenizer = load_tokenizer(tiny_model_dir)
    (tmp_path / "rewards.py").write_text(KILL_ONCE)
    policy = FailurePolicy(episode_retries=1, episode_retry_delay=0.01, episode_timeout=120)
    with RewardPool(max_workers=2, timeout=1.0) as pool:
        workflow = _rlvr(tokenizer, pool, RewardReference(f"{tmp_path}/rewards.py:hang"))
        pool.warm_up(workflow.reward_fn)[0].result(timeout=60)
        start = time.monotonic()
        result = asyncio.run(play_group(workflow, _scripted(tokenizer), DATA, 2, slot=0, policy=policy))
    assert time.monotonic() - start < 180  # two timeouts of 1 s each and the replaced workers' starts, not 900 s
    assert (result.outcome, result.trajectories) == ("dropped", [])
    assert [(f.cause, f.attempt) for f in result.failures] == [("reward_timeout", 2)] * 2
    assert failure_stats([result])["failures/reward_timeout"] == 2


def test_the_retrieval_server_killed_and_restarted_mid_rollout_costs_retries_not_trajectories(tiny_model_dir,
                                                                                             tmp_path):
    from areal_pipeline.model import load_tokenizer
    from areal_pipeline.run_spec import load_config
    from areal_pipeline.tools.retrieval_client import RetrievalClient
    from areal_pipeline.tools.retrieval_server import launch_retrieval_server
    from areal_pipeline.utils import find_free_port
    from areal_pipeline.workflows.search_agent import SearchAgentWorkflow
    from areal_pipeline.rewards import f1_reward

    tokenizer = load_tokenizer(tiny_model_dir)
    port = find_free_port()
    cfg = load_config("configs/search_agent.yaml", [f"output_dir={tmp_path}", f"rollout.agent.retrieval.port={port}"])
    address = f"127.0.0.1:{port}"
    queries = ["capital", "born", "river", "mountain"]

    def respond(req, turn):
        seed = req.sampling.sampling_seed or 0
        text = f"<search>{queries[seed % 4]}</search>" if turn == 0 else "<answer> Paris </answer>"
        return tokenizer.encode(text, add_special_tokens=False)

    workflow = SearchAgentWorkflow(f1_reward, GenerationConfig(n_samples=2, max_new_tokens=48), tokenizer,
                                   RetrievalClient(address, retries=0), max_turns=3, topk=2)
    slots = {i: {"prompt_id": f"q{i}", "question": "Where?", "answer": ["Paris"], "sampling_seed": 11 * i + 1,
                 "messages": [{"role": "user", "content": "Where?"}]} for i in range(4)}
    # retries 1, 2, 4, ... s apart: room for a restart on a busy machine
    policy = FailurePolicy(episode_retries=6, episode_retry_delay=1.0, episode_timeout=120)

    def batch():
        return asyncio.run(play_batch(workflow, ScriptedEngine(respond), slots, max_concurrent_rollouts=8,
                                      n_samples=2, policy=policy, progress=False))

    server = launch_retrieval_server(cfg, tmp_path / "logs")
    try:
        reference = batch()
        os.kill(server.popen.pid, signal.SIGKILL)
        server.stop()

        async def restart_later():
            await asyncio.sleep(1.5)
            return await asyncio.to_thread(launch_retrieval_server, cfg, tmp_path / "logs")

        async def disturbed():
            restarting = asyncio.ensure_future(restart_later())
            groups = await play_batch(workflow, ScriptedEngine(respond), slots, max_concurrent_rollouts=8,
                                      n_samples=2, policy=policy, progress=False)
            return groups, await restarting

        groups, server = asyncio.run(disturbed())
    finally:
        server.stop()
    assert [g.outcome for g in groups] == ["ok"] * 4
    assert all(f.cause == "retrieval" and f.peer == address for g in groups for f in g.retried)
    assert failure_stats(groups)["retries/retrieval"] >= 8  # every episode's first search hit the dead server
    assert [_rows(g.trajectories) for g in groups] == [_rows(g.trajectories) for g in reference]
    assert all(t.metadata["num_searches"] == 1 for g in groups for t in g.trajectories)


def test_the_iteration_card_lists_the_failed_episodes_and_the_table_keeps_one_rate(tmp_path):
    from areal_pipeline.pipeline import Pipeline
    from areal_pipeline.run_spec import load_config
    from flows.artifacts import failures_markdown, table_metrics

    pipeline = Pipeline(load_config("configs/tiny_cpu.yaml", [f"output_dir={tmp_path}", "run_id=r"]))
    ok, dropped = _failing_batch("drop", {("b", 1): 1, ("b", 2): 1})
    _finish([ok], pipeline.paths.rollout(1))
    assert failures_markdown(pipeline, 1) == ""  # nothing failed
    assert failures_markdown(pipeline, 2) == ""  # no rollout (yet)
    _finish([ok, dropped], pipeline.paths.rollout(1))
    card = failures_markdown(pipeline, 1)
    assert "2 episode(s) failed for good (rollout.on_failure=drop)" in card
    assert f"| inference | {SERVER} | 2 | InferenceServerError: inference server {SERVER}/generate: HTTP 503 |" in card
    record = {"reward_mean": 1.0, **rollout_stats(ok.trajectories, 1.0, [ok, dropped])}
    assert record["failures/inference"] == 2
    shown = table_metrics(record)
    assert shown["failure_rate"] == 2 / 6 and shown["groups_dropped"] == 1
    assert not any(key.startswith(("failures/", "retries/")) for key in shown)
