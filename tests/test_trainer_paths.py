"""Trainer paths the config advertises, each against an independent computation (a plain forward of the model, the
algorithm written out by hand): KL to a frozen reference model (`ppo.kl_ctl`), compute_logp and proximal logprobs
over 2 ranks (real torchrun, gloo), bfloat16 parameters with fp32 master weights (`trainer.param_dtype`), and
`ppo.recompute_logprob` without the decoupled loss. The in-process checks drive `trainer_server.Trainer`, the
handlers the trainer process runs, in a world of one."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from areal_pipeline.training.client import launch_trainer
from areal_pipeline.training.engine import TrainEngine
from areal_pipeline.training.ppo import read_batch, write_batch
from areal_pipeline.training.trainer_server import Trainer
from test_trainer import (hand_ppo_loss, make_batch, make_rollout, plain_logprobs, single_process_group,  # noqa: F401
                          trainer_config, weights)


def max_difference(a: list[list[float]], b: list[list[float]]) -> float:
    assert [len(row) for row in a] == [len(row) for row in b]
    return max(abs(x - y) for p, q in zip(a, b) for x, y in zip(p, q))


def hand_grpo_batch(rewards, groups, behaviour, reference, loss_mask, kl_ctl: float, eps: float = 1e-5):
    """GRPO with a k3 KL penalty written out: rewards normalised within their group (unbiased std), each generated
    token's reward -kl_ctl * k3 plus the task reward on the last one, undiscounted returns, and the returns
    normalised over every generated token of the batch. Returns (task rewards, kl, token rewards, advantages)."""
    members: dict[str, list[float]] = {}
    for reward, group in zip(rewards, groups):
        members.setdefault(group, []).append(reward)

    def normalise(x: float, values: list[float]) -> float:
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
        return (x - mean) / (std + eps)

    task = [normalise(r, members[g]) for r, g in zip(rewards, groups)]
    kl, token_rewards, returns = [], [], []
    for b, mask in enumerate(loss_mask):
        # k3 = exp(log r) - log r - 1 with log r = ref - behaviour (the clamps never bind at these sizes)
        kl.append([(math.exp(reference[b][t] - behaviour[b][t]) - (reference[b][t] - behaviour[b][t]) - 1) * m
                   for t, m in enumerate(mask)])
        last = max(t for t, m in enumerate(mask) if m)
        token_rewards.append([-kl_ctl * kl[b][t] * m + (task[b] if t == last else 0.0) for t, m in enumerate(mask)])
        row, running = [0.0] * len(mask), 0.0
        for t in reversed(range(len(mask))):
            if mask[t]:
                running += token_rewards[b][t]
                row[t] = running
        returns.append(row)
    generated = [r for row, mask in zip(returns, loss_mask) for r, m in zip(row, mask) if m]
    advantages = [[normalise(r, generated) if m else 0.0 for r, m in zip(row, mask)]
                  for row, mask in zip(returns, loss_mask)]
    return task, kl, token_rewards, advantages


def test_two_ranks_kl_to_a_frozen_reference_and_proximal_logprobs(single_process_group, tiny_model_dir, tmp_path):
    """One 2-rank trainer: compute_logp of the actor and of the reference over 2 ranks (15 sequences, so the ranks'
    shares differ) equal a plain forward; the batch's KL column and advantages are GRPO with the k3 penalty against
    those reference logprobs, written out by hand; an update of the decoupled loss over 2 minibatches (its proximal
    logprobs a 2-rank compute_logp) gives the stats and weights of the same update on one rank; after it the actor's
    logprobs are the new weights' and the reference's are still the initial model's."""
    overrides = ("ppo.kl_ctl=0.1", "ppo.kl_estimator=k3", "ppo.use_decoupled_loss=true", "ppo.ppo_n_minibatches=2",
                 "trainer.num_threads=1")
    cfg = trainer_config(tmp_path, "trainer.nproc=2", *overrides)
    rollout = make_rollout(tiny_model_dir, tmp_path, seed=7, n_prompts=5, group=3)
    columns = read_batch(rollout, ("input_ids", "logprobs", "loss_mask", "reward", "group_id"))
    initial = plain_logprobs(tiny_model_dir, columns["input_ids"])

    def logprobs(model: str, name: str) -> list[list[float]]:
        out = tmp_path / f"{name}.parquet"
        client.call("compute_logp", shard_dir=str(rollout), out_path=str(out), model=model)
        return pq.read_table(out).column("logprobs").to_pylist()

    process, client = launch_trainer(cfg, str(tiny_model_dir), tmp_path / "logs")
    try:
        assert client.call("status")["world_size"] == 2
        actor_before, reference = logprobs("actor", "actor-0"), logprobs("ref", "ref-0")
        assert max_difference(actor_before, initial) < 1e-5
        assert max_difference(reference, initial) < 1e-5

        batch_dir = tmp_path / "batch"
        write_batch(rollout, batch_dir, cfg.ppo, run_id="t", iteration=1,
                    extra_token_columns={"ref_logprobs": reference})
        batch = read_batch(batch_dir, ("kl", "token_rewards", "advantages", "task_reward"))
        task, kl, token_rewards, advantages = hand_grpo_batch(columns["reward"], columns["group_id"],
                                                              columns["logprobs"], initial, columns["loss_mask"],
                                                              kl_ctl=0.1)
        assert max_difference(batch["kl"], kl) < 1e-5
        assert min(v for row, mask in zip(kl, columns["loss_mask"]) for v, m in zip(row, mask) if m) > 0.004
        assert max_difference(batch["token_rewards"], token_rewards) < 1e-5
        assert max_difference(batch["advantages"], advantages) < 1e-4
        assert batch["task_reward"] == pytest.approx(task, abs=1e-5)

        two = client.call("train", batch_dir=str(batch_dir), iteration=1)["stats"]
        client.call("save_weights", path=str(tmp_path / "v1"))
        actor_after, reference_after = logprobs("actor", "actor-1"), logprobs("ref", "ref-1")
    finally:
        process.stop()

    trained = plain_logprobs(tmp_path / "v1", columns["input_ids"])
    assert max_difference(actor_after, trained) < 1e-5
    assert max_difference(trained, initial) > 1e-2  # the actor moved
    assert max_difference(reference_after, initial) < 1e-5  # the reference did not

    # the proximal policy is the initial model for both minibatches (logprobs taken before the first step)
    rows = len(columns["input_ids"])
    halves = [range(0, round(rows / 2)), range(round(rows / 2), rows)]
    behave = [[math.exp(initial[b][t] - columns["logprobs"][b][t]) for b in half
               for t, m in enumerate(columns["loss_mask"][b]) if m] for half in halves]
    assert two["behave_imp_weight"] == pytest.approx(sum(sum(w) / len(w) for w in behave) / 2, rel=1e-5)

    one_rank = Trainer(trainer_config(tmp_path / "one", *overrides), str(tiny_model_dir))
    one_rank.initialize()
    one = one_rank.train(str(batch_dir), 1)["stats"]
    for key in ("loss", "grad_norm", "clip_fraction", "approx_kl", "behave_imp_weight", "importance_weight",
                "entropy", "loss_weight"):
        assert two[key] == pytest.approx(one[key], rel=1e-4, abs=1e-6), key
    one_weights, two_weights = one_rank.actor.full_state_dict(), weights(tmp_path / "v1")
    for name, value in two_weights.items():  # Adam's lr-sized steps on near-zero gradients: see test_trainer
        assert torch.allclose(value, one_weights[name], atol=1e-4), name
