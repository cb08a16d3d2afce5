"""Trainer paths the config advertises, each against an independent computation (a plain forward of the model, the
algorithm written out by hand): KL to a frozen reference model (`ppo.kl_ctl`), compute_logp and proximal logprobs
over 2 ranks (real torchrun, gloo), bfloat16 parameters with fp32 master weights (`trainer.param_dtype`), and
`ppo.recompute_logprob` without the decoupled loss. The in-process checks drive `trainer_server.Trainer`, the
handlers the trainer process runs, in a world of one."""

from __future__ import annotations

import json
import math

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from areal_pipeline.training.client import launch_trainer
from areal_pipeline.training.engine import TrainEngine
from areal_pipeline.training.loss_registry import make_loss
from areal_pipeline.training.batches import read_batch, write_batch
from areal_pipeline.training.trainer_server import Trainer
from _trainer_helpers import (hand_ppo_loss, make_batch, make_rollout, plain_logprobs,  # noqa: F401
                              single_process_group, trainer_config, weights)


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


def test_bfloat16_parameters_keep_fp32_master_weights(single_process_group, tiny_model_dir, tmp_path):
    """trainer.param_dtype=bfloat16: the forward runs in bfloat16 (its logprobs off a plain fp32 forward by bf16
    rounding, not more), while the parameters, Adam's moments and the checkpoint stay fp32 as the config says; the
    update is the fp32 run's within bf16 tolerance."""
    batch_dir = make_batch(tiny_model_dir, tmp_path, seed=2, cfg=trainer_config(tmp_path))
    sequences = read_batch(batch_dir, ("input_ids",))
    plain = plain_logprobs(tiny_model_dir, sequences["input_ids"])

    def update(param_dtype: str):
        trainer = Trainer(trainer_config(tmp_path / param_dtype, f"trainer.param_dtype={param_dtype}"),
                          str(tiny_model_dir))
        trainer.initialize()
        logp = trainer.actor.compute_logp(sequences)
        stats = trainer.train(str(batch_dir), 1)["stats"]
        return trainer, logp, stats

    half, half_logp, half_stats = update("bfloat16")
    full, full_logp, full_stats = update("float32")
    assert max_difference(full_logp, plain) < 1e-5
    # bf16 keeps 8 bits of mantissa: far coarser than fp32's rounding, far finer than a different model
    assert 1e-3 < max_difference(half_logp, plain) < 0.05

    assert {p.dtype for p in half.actor.model.parameters()} == {torch.float32}
    moments = [s[k] for s in half.actor.optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    assert moments and {m.dtype for m in moments} == {torch.float32}

    half.save(str(tmp_path / "ckpt"))
    model_files = load_file(str(tmp_path / "ckpt" / "model" / "model.safetensors"))
    optimizer_files = load_file(str(tmp_path / "ckpt" / "optimizer.safetensors"))
    assert {t.dtype for t in model_files.values()} == {torch.float32}
    assert {t.dtype for name, t in optimizer_files.items() if not name.endswith("::step")} == {torch.float32}
    config = json.loads((tmp_path / "ckpt" / "model" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "float32"

    initial = weights(tiny_model_dir)
    after_half, after_full = half.actor.full_state_dict(), full.actor.full_state_dict()
    assert all(torch.equal(model_files[name], after_half[name]) for name in model_files)
    step_half = torch.cat([(after_half[n] - initial[n]).flatten() for n in initial])
    step_full = torch.cat([(after_full[n] - initial[n]).flatten() for n in initial])
    # Adam's first step is about lr * sign(gradient): the bf16 gradients point the same way, element by element
    # except where a gradient is near 0
    assert float(torch.nn.functional.cosine_similarity(step_half, step_full, dim=0)) > 0.97
    assert float(step_half.norm()) == pytest.approx(float(step_full.norm()), rel=0.01)
    for key in ("loss", "grad_norm", "entropy"):
        assert half_stats[key] == pytest.approx(full_stats[key], rel=0.01), key
    assert half_stats["clip_fraction"] == pytest.approx(full_stats["clip_fraction"], abs=0.02)
    for name in initial:  # the master weights hold fp32 values that bf16 cannot
        assert not torch.equal(after_half[name], after_half[name].bfloat16().float()), name


def test_recompute_logprob_without_the_decoupled_loss(single_process_group, tiny_model_dir, tmp_path):
    """ppo.recompute_logprob with the plain PPO loss: the "old" logprobs are the current model's, recomputed, not
    the batch's stale behaviour ones. With one minibatch (taken from the training forward) every ratio is 1, so the
    loss is -mean(A) and nothing is clipped; with two (a compute_logp pass first) the update is the one whose old
    logprobs come from a plain forward of the model, and not the one with the behaviour logprobs."""
    def config(*overrides: str):
        # advantages left uncentred, so that -mean(A) is not 0 by construction
        return trainer_config(tmp_path, "ppo.recompute_logprob=true", "ppo.adv_norm.mean_level=none", *overrides)

    cfg = config()
    assert not cfg.ppo.use_decoupled_loss
    batch_dir = make_batch(tiny_model_dir, tmp_path, seed=4, cfg=cfg)
    batch = read_batch(batch_dir, ("input_ids", "loss_mask", "logprobs", "advantages"))
    plain = plain_logprobs(tiny_model_dir, batch["input_ids"])
    mask, adv = batch["loss_mask"], batch["advantages"]
    # against the behaviour logprobs PPO would clip many tokens: the recomputed ones must be what the loss reads
    assert hand_ppo_loss(plain, batch["logprobs"], adv, mask, cfg.ppo.eps_clip)[1] > 0.1

    def trainer_update(cfg) -> tuple[dict, dict[str, torch.Tensor]]:
        trainer = Trainer(cfg, str(tiny_model_dir))
        trainer.initialize()
        assert trainer.loss.policy_columns == ("prox_logprobs",)
        stats = trainer.train(str(batch_dir), 1)["stats"]
        return stats, trainer.actor.full_state_dict()

    def update_with_old_logprobs(cfg, old: list[list[float]]) -> dict[str, torch.Tensor]:
        """The same update with the "old" logprobs given as data, not computed by the trainer."""
        loss = make_loss(cfg.ppo)
        engine = TrainEngine(str(tiny_model_dir), cfg.trainer, total_steps=4)
        engine.initialize()
        engine.train_batch({**batch, "prox_logprobs": old}, loss.fn, loss.weight, loss.columns,
                           cfg.ppo.ppo_n_minibatches)
        return engine.full_state_dict()

    def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
        return max(float((a[name] - b[name]).abs().max()) for name in a)

    one, one_weights = trainer_update(cfg)
    tokens = sum(map(sum, mask))
    minus_mean_advantage = -sum(a * m for row, mrow in zip(adv, mask) for a, m in zip(row, mrow)) / tokens
    assert abs(minus_mean_advantage) > 0.05
    assert one["loss"] == pytest.approx(minus_mean_advantage, abs=1e-5)
    assert one["importance_weight"] == pytest.approx(1.0, abs=1e-6)
    assert one["clip_fraction"] == 0.0 and one["approx_kl"] == pytest.approx(0.0, abs=1e-7)
    # A plain forward's logprobs differ from the engine's by fp32 rounding, which Adam turns into lr-sized steps on
    # elements whose gradient is near 0 (see test_trainer); the behaviour logprobs flip whole steps (2 * lr).
    lr = cfg.trainer.optimizer.lr
    assert largest_difference(one_weights, update_with_old_logprobs(cfg, plain)) < 0.25 * lr
    assert largest_difference(one_weights, update_with_old_logprobs(cfg, batch["logprobs"])) > lr

    cfg = config("ppo.ppo_n_minibatches=2")
    two, two_weights = trainer_update(cfg)
    assert largest_difference(two_weights, update_with_old_logprobs(cfg, plain)) < 0.25 * lr
    assert largest_difference(two_weights, update_with_old_logprobs(cfg, batch["logprobs"])) > lr
    assert two["clip_fraction"] < 0.1  # the second minibatch's ratios are one step's change, not the staleness
