"""A LoRA run (trainer.lora, the adapter alone pushed to the project's server) interrupted and run again ends where
an uninterrupted one does: the same episodes and advantages, bitwise the same adapters and optimizer state. After
`kill -9` of `areal-pipeline train` (the rerun's new trainer starts from the adapters its seed gives and replays the
updates before, its fresh server is pushed the adapters again) and after a failed iteration run again (the trainer
loads the LoRA checkpoint, adapters and their optimizer, and replays the update after it). And a LoRA run's
rollouts re-scored by another reward train adapters from the parent's adapter checkpoint (`rescore`, then
`branch --replay --rescored`).

The real pipeline throughout: the project's CPU servers, the torchrun trainer, Parquet shards, Prefect's engine
against a local API; the embedded default's warm-started base, as tests/test_lora_learns.py runs it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from _rollouts import assert_same_episodes
from areal_pipeline.data.shards import read_table
from test_flows import REPO, cli, fast_overrides

ITERATIONS = 4
LORA = ("trainer.lora.enabled=true", "trainer.optimizer.lr=3e-3")

INVERTED_REWARD = '''
from areal_pipeline.rewards.math import math_reward


def inverted(completion, answer):
    """The run's own reward turned around: 1 for a wrong answer, 0 for the right one."""
    return 1.0 - math_reward(completion, answer)
'''


def lora_overrides(out: Path, model: str, run_id: str) -> list[str]:
    """4 iterations of 8 prompts x 4 samples in one flow run, a checkpoint at 2 and 4, no evaluation."""
    return [*fast_overrides(out, Path(model), run_id=run_id, iterations=ITERATIONS, per_flow_run=ITERATIONS),
            "rollout.batch_size=8", "save_freq=2", "eval_freq=0", *LORA]


def adapter(run_dir: Path, k: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{k}" / "adapter" / "adapter_model.safetensors"))


def rewards(run_dir: Path, k: int) -> list[float]:
    return read_table(run_dir / f"iter_{k}" / "rollout").column("reward").to_pylist()


def assert_same_run(run_dir: Path, reference: Path) -> None:
    """Every iteration's episodes (tokens, versions, rewards) and advantages, and the final adapters and their
    optimizer state, are the uninterrupted run's: bitwise.

    The episodes' sampled logprobs to 1e-5 (_rollouts.py says why). Nothing trains on them here (the trainer
    recomputes the old logprobs: ppo.recompute_logprob)."""
    assert_same_episodes(run_dir, reference, range(1, ITERATIONS + 1))
    for k in range(1, ITERATIONS + 1):
        mine, theirs = (read_table(d / f"iter_{k}" / "batch", schema=None) for d in (run_dir, reference))
        assert mine.column("advantages").to_pylist() == theirs.column("advantages").to_pylist(), k
    final = Path("checkpoints") / f"step_{ITERATIONS}"
    for name in ("adapter/adapter_model.safetensors", "optimizer.safetensors", "model/model.safetensors"):
        a, b = (load_file(str(d / final / name)) for d in (run_dir, reference))
        assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a), name
    trained = adapter(run_dir, ITERATIONS)
    assert any(".lora_B." in n and bool(trained[n].any()) for n in trained)  # B left 0
    state, ref_state = (json.loads((d / final / "trainer_state.json").read_text()) for d in (run_dir, reference))
    assert state["lora"] == ref_state["lora"] and state["lora"]["rank"] == 8
    assert_pushed_adapters_alone(run_dir)


def assert_pushed_adapters_alone(run_dir: Path) -> None:
    """The servers were pushed PEFT adapter directories, not full weights (trainer.lora.push=auto, disk sync)."""
    pushed = run_dir / "weights" / f"v{ITERATIONS}"  # the last push (the ones before it pruned)
    assert sorted(p.name for p in pushed.parent.iterdir()) == [pushed.name]
    assert sorted(p.name for p in pushed.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


@pytest.fixture(scope="module")
def reference(prefect_api, default_base_model, tmp_path_factory) -> Path:
    """Run `ref`: the LoRA run uninterrupted (the train flow, in this process)."""
    from flows.train import train

    out = tmp_path_factory.mktemp("runs")
    train(config_path=str(REPO / "configs/tiny_cpu.yaml"), overrides=lora_overrides(out, default_base_model, "ref"))
    run_dir = out / "ref"
    assert_pushed_adapters_alone(run_dir)
    return run_dir


def test_a_killed_lora_run_reruns_to_the_same_adapters_and_rollouts(prefect_api, default_base_model, reference,
                                                                    tmp_path):
    """`areal-pipeline train` killed (SIGKILL) once iteration 2's rollout is on disk, before any checkpoint; the same
    command again goes on at 2: its new trainer starts from the adapters the seed gives and replays update 1 from
    its batch shards, its fresh server (on the base) is pushed the adapters it then trains, and the run's episodes,
    advantages and final adapters are the uninterrupted run's."""
    from test_rollout_resume import _kill_when

    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    command = ["train", "--config", "configs/tiny_cpu.yaml", *lora_overrides(tmp_path, default_base_model, "killed")]
    run_dir = tmp_path / "killed"
    victim = cli(*command, env=env)
    _kill_when(victim, lambda: (run_dir / "iter_2" / "rollout" / "manifest.json").exists(),
               "iteration 2's rollout")
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
    rerun = cli(*command, env=env)
    out, _ = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, out[-3000:]
    assert "iterations 1..1 are finished; continuing at 2" in out, out[-3000:]
    log = (run_dir / "logs" / "train.log").read_text()
    assert "trainer at version 0: replaying updates 1..1 from their batch shards" in log, log[-3000:]
    assert_same_run(run_dir, reference)


def block_iteration(run_dir: Path, k: int) -> Path:
    """tests/test_retry.py's fault at iteration k: a file where its directory goes, so that its rollout cannot write
    its shards (the node fails at once, no retries) until the test removes it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    blocker = run_dir / f"iter_{k}"
    blocker.write_text("not a directory\n")
    return blocker


def test_a_lora_run_failed_at_iteration_4_runs_again_to_the_same_adapters(default_base_model, reference, tmp_path):
    """Iteration 4's rollout fails, and the train flow run with it; once the fault is gone the same run again goes
    on at 4 with a new trainer and server: the trainer loads the LoRA checkpoint 2 (adapters, their optimizer and
    schedule) and replays update 3 from its batch shards, the server is pushed that adapter, and the run ends as the
    uninterrupted one."""
    from flows.train import train

    run_dir = tmp_path / "failed"
    blocker = block_iteration(run_dir, 4)
    overrides = lora_overrides(tmp_path, default_base_model, "failed")
    with pytest.raises(Exception, match="Not a directory"):
        train(config_path=str(REPO / "configs/tiny_cpu.yaml"), overrides=overrides)
    assert [json.loads(line)["iteration"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            ] == [1, 2, 3]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_2"]
    blocker.unlink()
    train(config_path=str(REPO / "configs/tiny_cpu.yaml"), overrides=overrides)
    log = (run_dir / "logs" / "train.log").read_text()
    assert "iterations 1..3 are finished; continuing at 4" in log, log[-3000:]
    assert "trainer at version 2: replaying updates 3..3 from their batch shards" in log, log[-3000:]
    assert [json.loads(line)["iteration"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            ] == [1, 2, 3, 4]
    assert_same_run(run_dir, reference)


def test_a_rescored_lora_run_replays_into_adapters_from_the_parent_s(prefect_api, reference, tmp_path):
    """`rescore` of the LoRA run `ref` by its reward turned around, then `branch --replay --rescored` at 2: the
    replay's trainer starts from the parent's adapter checkpoint 2 and trains adapters (its checkpoint a PEFT
    adapter with the parent's LoRA settings, its pushes the adapter alone) on advantages computed from the new
    rewards (here exactly the parent's negated), so its adapters part from the parent's."""
    from flows.branch import branch
    from flows.rescore import rescore

    (tmp_path / "inverted_reward.py").write_text(INVERTED_REWARD)
    scorer = f"{tmp_path / 'inverted_reward.py'}:inverted"
    record = rescore(run_id="ref", scorer=scorer, output_dir=str(reference.parent), reward=scorer,
                     iterations="3:4")
    assert [s["iteration"] for s in record["iterations"]] == [3, 4]
    for k in (3, 4):
        new = read_table(reference / f"rescored/inverted/iter_{k}/rollout").column("reward").to_pylist()
        assert new == [1.0 - r for r in rewards(reference, k)]

    result = branch(parent_run_id="ref", at=2, run_id="ref-inverted", output_dir=str(reference.parent),
                    mode="replay", rescored="inverted")
    assert result["rescored"] == "inverted" and result["regenerated"] == []
    run_dir = reference.parent / "ref-inverted"
    # iterations 1..2 and the checkpoint 2 (adapters, their optimizer) are the parent's own files
    assert os.path.samefile(run_dir / "checkpoints/step_2/adapter/adapter_model.safetensors",
                            reference / "checkpoints/step_2/adapter/adapter_model.safetensors")
    log = (run_dir / "logs" / "train.log").read_text()
    assert "iterations 1..2 are finished; continuing at 3" in log, log[-3000:]
    for k in (3, 4):
        batch = read_table(run_dir / f"iter_{k}/batch", schema=None)
        parent_batch = read_table(reference / f"iter_{k}/batch", schema=None)
        assert batch.column("reward").to_pylist() == [1.0 - r for r in parent_batch.column("reward").to_pylist()]
        new, old = batch.column("advantages").to_pylist(), parent_batch.column("advantages").to_pylist()
        assert any(a != 0 for row in old for a in row)
        assert new == [[-a for a in row] for row in old]  # GRPO's group and batch normalisations: r -> 1 - r flips
    # update 3 started from the parent's adapters 2: its policy's entropy on iteration 3's episodes (measured before
    # the step: one minibatch) is the parent's update 3's; update 4 starts from adapters the new rewards moved
    updates = [{k: json.loads((d / f"iter_{k}/update.json").read_text()) for k in (3, 4)} for d in (run_dir, reference)]
    assert updates[0][3]["entropy"] == updates[1][3]["entropy"] and updates[0][3]["n_minibatches"] == 1
    assert updates[0][4]["entropy"] != updates[1][4]["entropy"]
    assert_pushed_adapters_alone(run_dir)  # the replay's servers took its adapters too
    final = run_dir / "checkpoints" / f"step_{ITERATIONS}"
    assert sorted(p.name for p in (final / "adapter").iterdir()) == ["adapter_config.json",
                                                                     "adapter_model.safetensors"]
    assert (json.loads((final / "trainer_state.json").read_text())["lora"]
            == json.loads((reference / f"checkpoints/step_{ITERATIONS}/trainer_state.json").read_text())["lora"])
    mine, theirs, start = adapter(run_dir, ITERATIONS), adapter(reference, ITERATIONS), adapter(reference, 2)
    assert mine.keys() == theirs.keys() == start.keys()
    assert any(not torch.equal(mine[n], theirs[n]) for n in mine)  # other rewards, other adapters
    assert any(not torch.equal(mine[n], start[n]) for n in mine)  # and trained past the parent's checkpoint 2
    # the base under the adapters never moved: the merged policy differs from the base only in adapted layers
    base = load_file(str(Path(json.loads((final / "adapter" / "adapter_config.json").read_text())
                                ["base_model_name_or_path"]) / "model.safetensors"))
    merged = load_file(str(final / "model" / "model.safetensors"))
    assert merged.keys() == base.keys()
    assert all(torch.equal(merged[n], base[n]) for n in base if not n.endswith("_proj.weight"))
