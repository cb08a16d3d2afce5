"""Rollouts end to end: real servers, workflow, reward pool, shards."""

import asyncio
import json
import subprocess
import sys

from areal_pipeline.data.shards import read_trajectories, verify_shards
from areal_pipeline.inference.client import RemoteSGLangEngine
from areal_pipeline.model import load_tokenizer
from areal_pipeline.rewards.pool import RewardPool
from areal_pipeline.rollout.executor import run_episodes, select_batch
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
                return await run_episodes(workflow, engine, records, max_concurrent_rollouts=8,
                                          samples_per_episode=4, progress=False)

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
