"""Rollouts end to end: real servers, workflow, reward pool, shards."""

import asyncio
import json
import subprocess
import sys

import pytest

from areal_pipeline.data.shards import read_trajectories, verify_shards
from areal_pipeline.data.trajectory import Trajectory
from areal_pipeline.inference.client import RemoteSGLangEngine
from areal_pipeline.model import load_tokenizer
from areal_pipeline.rewards.pool import RewardPool
from areal_pipeline.inference.types import ModelRequest, ModelResponse, SamplingParams
from areal_pipeline.rollout.executor import rollout_stats, run_episodes, select_batch
from areal_pipeline.rollout.group import run_group
from areal_pipeline.run_spec import load_config
from areal_pipeline.workflows.rlvr import RLVRWorkflow, chat_prompt_ids


def test_select_batch_is_a_pure_function_of_iteration():
    records = [{"prompt_id": str(i)} for i in range(10)]
    epoch = [r["prompt_id"] for k in range(5) for r in select_batch(records, k, 2, seed=1)]
    assert sorted(epoch) == sorted(r["prompt_id"] for r in records)  # one epoch covers every record once
    assert select_batch(records, 7, 3, seed=1) == select_batch(records, 7, 3, seed=1)
    assert select_batch(records, 0, 10, seed=1) != select_batch(records, 0, 10, seed=2)


def _reward_is_digit_7(completion: str, answer: str) -> float:
    return 1.0 if completion.startswith(answer) else 0.0


def test_grouped_rlvr_episodes_against_a_real_server(cpu_server, tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    cfg = load_config(None, ["rollout.gconfig.n_samples=4", "rollout.gconfig.max_new_tokens=6"])
    records = [{"prompt_id": f"p{i}", "messages": [{"role": "user", "content": f"say {i}"}], "answer": str(i)}
               for i in range(5)]

    async def go():
        with RewardPool(timeout=10) as pool:
            workflow = RLVRWorkflow(_reward_is_digit_7, cfg.rollout.gconfig, tokenizer, pool)
            async with RemoteSGLangEngine([cpu_server]) as engine:
                return await run_episodes(workflow, engine, records, max_concurrent_rollouts=8, n_samples=4,
                                          progress=False)

    trajectories = asyncio.run(go())
    assert [t.prompt_id for t in trajectories] == [f"p{i}" for i in range(5) for _ in range(4)]
    assert [t.sample_idx for t in trajectories[:4]] == [0, 1, 2, 3]
    for t, record in zip(trajectories, [r for r in records for _ in range(4)]):
        prompt = chat_prompt_ids(tokenizer, record["messages"])
        assert t.input_ids[: len(prompt)] == prompt
        assert t.loss_mask == [0] * len(prompt) + [1] * (len(t.input_ids) - len(prompt))
        assert 1 <= t.num_generated <= 6
        assert all(v == -1 for v in t.versions[: len(prompt)]) and all(v == 0 for v in t.versions[len(prompt):])
        assert all(lp < 0 for lp in t.logprobs[len(prompt):])
        assert t.reward == _reward_is_digit_7(t.text, record["answer"])
        assert t.text == tokenizer.decode(t.input_ids[len(prompt):], skip_special_tokens=True)


def test_rollout_command_writes_verified_shards(tmp_path):
    args = [sys.executable, "-m", "cli", "rollout", "--config", "configs/tiny_cpu.yaml",
            f"output_dir={tmp_path}", "run_id=r1", "rollout.batch_size=6", "rollout.gconfig.n_samples=3",
            "rollout.shard_rows=8", "inference.num_servers=2"]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out_dir = tmp_path / "r1" / "iter_1" / "rollout"
    verify_shards(out_dir)
    manifest = json.loads((out_dir / "manifest.json").read_text())
    assert manifest["num_rows"] == 18 and len(manifest["shards"]) == 3
    assert manifest["stats"]["num_trajectories"] == 18
    trajectories = read_trajectories(out_dir)
    assert len({t.metadata["server"] for t in trajectories}) == 2  # round robin over both servers
    assert (tmp_path / "r1" / "config.yaml").is_file()
    assert json.loads(done.stdout[: done.stdout.rindex("}") + 1])["num_trajectories"] == 18


def test_rollout_command_rejects_unknown_key(tmp_path):
    done = subprocess.run([sys.executable, "-m", "cli", "rollout", f"output_dir={tmp_path}",
                           "rollout.batchsize=3"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "rollout.batch_size" in done.stderr and not (tmp_path / "tiny-cpu").exists()


# ---------------------------------------------------------------------------------------------- the group


class _Episodes:
    """A workflow of one generation per episode, recording what each episode saw; its trajectories say nothing of
    their group (the rollout sets it)."""

    def __init__(self, reward=lambda data: 1.0, fail_at=None):
        self.seen, self.reward, self.fail_at, self.cancelled = [], reward, fail_at, []

    async def arun_episode(self, engine, data):
        self.seen.append(data)
        resp = await engine.agenerate(ModelRequest(rid=f"{data['prompt_id']}/{data['sample_idx']}", input_ids=[1, 2],
                                                   sampling=SamplingParams()))
        if data["sample_idx"] == self.fail_at:
            raise ValueError("episode failed")
        try:
            await asyncio.sleep(0 if self.fail_at is None else 30)
        except asyncio.CancelledError:
            self.cancelled.append(data["sample_idx"])
            raise
        return Trajectory(prompt_id=data["prompt_id"], group_id="?", sample_idx=-7, input_ids=[1, 2, *resp.output_tokens],
                          loss_mask=[0, 0, 1], logprobs=[0.0, 0.0, -1.0], versions=[-1, -1, 0],
                          reward=self.reward(data))


class _BatchCounting:
    """An engine that answers every request with one token and records the size of each agenerate_group call."""

    def __init__(self):
        self.batches = []

    async def agenerate_group(self, reqs):
        self.batches.append([r.rid for r in reqs])
        return [ModelResponse(input_tokens=list(r.input_ids), output_tokens=[9], output_logprobs=[-1.0],
                              output_versions=[0], stop_reason="stop", latency=0.0) for r in reqs]


def test_the_executor_owns_the_group_its_seeds_and_its_order():
    workflow, engine = _Episodes(), _BatchCounting()
    records = [{"prompt_id": "a", "sampling_seed": (1 << 31) - 1}, {"prompt_id": "b"}]
    trajectories = asyncio.run(run_episodes(workflow, engine, records, max_concurrent_rollouts=8, n_samples=3,
                                            progress=False))
    assert [(t.group_id, t.sample_idx) for t in trajectories] == [(p, i) for p in "ab" for i in range(3)]
    seeds = {(d["prompt_id"], d["sample_idx"]): d.get("sampling_seed") for d in workflow.seen}
    assert [seeds["a", i] for i in range(3)] == [((1 << 31) - 1 + 1009 * i) % (1 << 31) for i in range(3)]
    assert [seeds["b", i] for i in range(3)] == [None] * 3  # an unseeded prompt's episodes stay unseeded
    # each group's first requests reach the engine together, one call per group
    assert sorted(engine.batches) == [["a/0", "a/1", "a/2"], ["b/0", "b/1", "b/2"]]
    assert all(t.baseline_reward is None for t in trajectories)


def test_a_baseline_episode_gives_its_reward_to_the_group_and_is_not_kept():
    workflow = _Episodes(reward=lambda data: float(data["sample_idx"]))
    baseline = _Episodes(reward=lambda data: 0.25)
    engine = _BatchCounting()
    group = asyncio.run(run_group(workflow, engine, {"prompt_id": "a", "sampling_seed": 5}, 2, baseline))
    assert [(t.sample_idx, t.reward, t.baseline_reward) for t in group] == [(0, 0.0, 0.25), (1, 1.0, 0.25)]
    (greedy,) = baseline.seen
    assert greedy["sample_idx"] == 2 and "sampling_seed" not in greedy
    assert engine.batches == [["a/0", "a/1", "a/2"]]
    assert rollout_stats(group, 1.0)["baseline_reward"] == 0.25
    assert "baseline_reward" not in rollout_stats(group[:0], 1.0)


def test_a_failing_episode_fails_its_group_and_cancels_the_others():
    workflow = _Episodes(fail_at=1)
    with pytest.raises(ValueError, match="episode failed"):
        asyncio.run(run_group(workflow, _BatchCounting(), {"prompt_id": "a"}, 3))
    assert sorted(workflow.cancelled) == [0, 2]

    class Nothing:
        async def arun_episode(self, engine, data):
            return {"not": "a trajectory"}

    with pytest.raises(TypeError, match="Nothing.arun_episode returned dict, not a Trajectory or a list of them"):
        asyncio.run(run_group(Nothing(), _BatchCounting(), {"prompt_id": "a"}, 1))


def test_a_refused_request_fails_only_its_own_episode_of_a_batched_call():
    """The server refuses a batch for one bad request in it: the episodes' requests go again one episode at a time,
    and only the episode that sent it sees the error (an OpenAI agent handles it as BadRequestError)."""
    class Refusing(_BatchCounting):
        async def agenerate_group(self, reqs):
            if any(r.rid.endswith("/1") for r in reqs):
                self.batches.append([r.rid for r in reqs])
                raise ValueError("context length exceeded")
            return await super().agenerate_group(reqs)

    class Careful(_Episodes):
        async def arun_episode(self, engine, data):
            try:
                return await super().arun_episode(engine, data)
            except ValueError:
                return []  # this episode trains nothing

    engine = Refusing()
    group = asyncio.run(run_group(Careful(), engine, {"prompt_id": "a"}, 3))
    assert [t.sample_idx for t in group] == [0, 2]
    assert engine.batches[0] == ["a/0", "a/1", "a/2"] and sorted(engine.batches[1:]) == [["a/0"], ["a/1"], ["a/2"]]
    assert len(engine.batches) == 4
