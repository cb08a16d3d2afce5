"""The FSDP train engine in this process (a real gloo world of one): its logprobs and losses against a plain forward
and PPO written out by hand, and each of its layouts and options against the plain one."""

from __future__ import annotations

import math
import random

import pytest
import torch

from areal_pipeline.model import load_model
from areal_pipeline.training.engine import TrainEngine
from areal_pipeline.training.losses import gather_logprobs
from areal_pipeline.training.loss_registry import make_loss
from areal_pipeline.training.packing import unpack
from areal_pipeline.training.batches import read_batch
from _trainer_helpers import (hand_ppo_loss, make_batch, plain_logprobs, single_process_group,  # noqa: F401
                              stale_offset, trainer_config, weights)


def whole_batch_setup(tmp_path, model_dir, seed: int):
    """A config whose one micro-batch holds the whole batch, a batch made with `seed`, and its loss."""
    cfg = trainer_config(tmp_path, "trainer.mb_max_tokens=100000")
    batch_dir = make_batch(model_dir, tmp_path, seed=seed, cfg=cfg)
    loss = make_loss(cfg.ppo)
    return cfg, read_batch(batch_dir, ("input_ids",) + loss.columns), loss.columns, loss.fn


def whole_batch_loss_and_grads(cfg, model_dir, batch, columns, loss_fn, attention: str = "sdpa"):
    """One micro-batch holding the whole batch through a fresh engine: (micro-batch, loss, gradients)."""
    engine = TrainEngine(str(model_dir), cfg.trainer, total_steps=4)
    engine.initialize()
    engine.model.set_attn_implementation(attention)
    (mb,) = engine._micro_batches(list(range(len(batch["input_ids"]))), batch, columns)
    logp, _ = engine._forward(mb)
    loss, _ = loss_fn(logp, None, mb)
    loss.backward()
    return mb, loss.detach(), {n: p.grad.full_tensor().clone() for n, p in engine.model.named_parameters()}


def test_packed_and_padded_batches_give_same_loss_and_gradients(single_process_group, tiny_model_dir, tmp_path):
    cfg, batch, columns, loss_fn = whole_batch_setup(tmp_path, tiny_model_dir, seed=0)
    results = []
    for pack in (True, False):
        cfg.trainer.pack_sequences = pack
        mb, loss, grads = whole_batch_loss_and_grads(cfg, tiny_model_dir, batch, columns, loss_fn)
        results.append((loss, grads))
    (loss_packed, g_packed), (loss_padded, g_padded) = results
    assert torch.allclose(loss_packed, loss_padded, atol=1e-6)
    for name in g_packed:
        assert torch.allclose(g_packed[name], g_padded[name], atol=1e-5), name

    # and both equal a plain padded forward of the unsharded model, the loss written out by hand
    model = load_model(tiny_model_dir)
    rows = mb.indices
    width = max(len(batch["input_ids"][i]) for i in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width)
    t = {k: torch.zeros(len(rows), width) for k in columns}
    for r, i in enumerate(rows):
        n = len(batch["input_ids"][i])
        ids[r, :n] = torch.tensor(batch["input_ids"][i])
        mask[r, :n] = 1
        for k in columns:
            t[k][r, :n] = torch.tensor(batch[k][i])
    logits = model(ids, attention_mask=mask.long()).logits
    logp = torch.zeros(len(rows), width)
    logp[:, 1:] = gather_logprobs(logits[:, :-1], ids[:, 1:])
    reference, _ = hand_ppo_loss(logp.tolist(), t["logprobs"].tolist(), t["advantages"].tolist(),
                                 t["loss_mask"].tolist(), cfg.ppo.eps_clip)
    assert float(loss_packed) == pytest.approx(reference, abs=1e-6)


def test_engine_logprobs_and_loss_at_stale_ratios_match_a_plain_forward(single_process_group, tiny_model_dir,
                                                                         tmp_path):
    """The engine's per-token logprobs (training forward and compute_logp) are a plain forward's, and its PPO loss
    and clip fraction are the clipped objective written out by hand, at behaviour logprobs stale enough that a
    known share of the tokens lies beyond each clip bound."""
    cfg, batch, columns, loss_fn = whole_batch_setup(tmp_path, tiny_model_dir, seed=0)
    engine = TrainEngine(str(tiny_model_dir), cfg.trainer, total_steps=4)
    engine.initialize()
    (mb,) = engine._micro_batches(list(range(len(batch["input_ids"]))), batch, columns)
    logp, _ = engine._forward(mb)
    loss, stats = loss_fn(logp, None, mb)
    forward = dict(zip(mb.indices, unpack(logp, mb)))
    engine_logp = [forward[i] for i in range(len(batch["input_ids"]))]

    plain = plain_logprobs(tiny_model_dir, batch["input_ids"])
    for computed in (engine_logp, engine.compute_logp(batch)):
        assert [len(row) for row in computed] == [len(row) for row in plain]
        assert max(abs(a - b) for x, y in zip(computed, plain) for a, b in zip(x, y)) < 1e-5

    # the ratios against the plain forward: each side's share is that of STALENESS' offsets of +-0.5
    eps = cfg.ppo.eps_clip
    above = below = tokens = expected_above = expected_below = 0
    for lp_row, old_row, mask_row in zip(plain, batch["logprobs"], batch["loss_mask"]):
        first = mask_row.index(1)
        for t in range(first, len(mask_row)):
            ratio = math.exp(lp_row[t] - old_row[t])
            above += ratio > 1 + eps
            below += ratio < 1 - eps
            expected_above += stale_offset(t - first) < math.log(1 / (1 + eps))
            expected_below += stale_offset(t - first) > -math.log(1 - eps)
            tokens += 1
    assert (above, below) == (expected_above, expected_below)
    assert 0.2 < above / tokens < 0.3 and 0.2 < below / tokens < 0.3

    expected_loss, expected_clipped = hand_ppo_loss(plain, batch["logprobs"], batch["advantages"],
                                                    batch["loss_mask"], eps)
    assert abs(expected_loss) > 0.02  # not the ~0 of ratio 1 with normalised advantages
    assert float(loss.detach()) == pytest.approx(expected_loss, abs=1e-6)
    assert float(stats["clip_fraction"]) == pytest.approx(expected_clipped, abs=0.1 / tokens)  # the same count
    assert 0.15 < expected_clipped < 0.45  # about half of the tokens beyond a bound: those whose advantage's sign
    # makes the clipped term the larger one


def test_compiled_decoder_layers_give_the_same_loss_and_gradients(single_process_group, tiny_model_dir, tmp_path):
    """trainer.compile_layers (on by default on CUDA, forced here on the CPU): each layer compiled before FSDP shards
    it gives eager's loss and gradients, and the compiler really ran (its graphs are counted)."""
    from torch._dynamo.utils import counters  # dynamo's own counters: the one way to see that a graph was compiled

    cfg, batch, columns, loss_fn = whole_batch_setup(tmp_path, tiny_model_dir, seed=3)
    cfg.trainer.compile_layers = False
    _, loss_eager, g_eager = whole_batch_loss_and_grads(cfg, tiny_model_dir, batch, columns, loss_fn)
    counters.clear()
    cfg.trainer.compile_layers = True
    _, loss_compiled, g_compiled = whole_batch_loss_and_grads(cfg, tiny_model_dir, batch, columns, loss_fn)
    assert counters["stats"]["unique_graphs"] >= 1
    assert torch.allclose(loss_eager, loss_compiled, atol=1e-5)
    for name in g_eager:
        assert torch.allclose(g_eager[name], g_compiled[name], atol=1e-4), name


def test_shared_prefixes_give_the_same_logprobs_loss_and_gradients(single_process_group, tiny_model_dir, tmp_path):
    """Each group's prompt laid out once, its samples as branches under an attention mask: the same logprobs,
    loss and gradients as one row per sequence, for sdpa and eager attention, for a fraction of the forward
    tokens. The few-token alphabet makes duplicate samples and samples that share their answer's start."""
    cfg = trainer_config(tmp_path, "trainer.mb_max_tokens=100000")
    batch_dir = make_batch(tiny_model_dir, tmp_path, seed=5, cfg=cfg, n_prompts=5, group=6, prompt_lengths=(14, 30),
                           completion_lengths=(1, 4), completion_vocab=3)
    loss_fn, _, columns, _ = make_loss(cfg.ppo)
    batch = read_batch(batch_dir, ("input_ids",) + columns)
    assert len({tuple(ids) for ids in batch["input_ids"]}) < len(batch["input_ids"])  # duplicates are in
    cfg.trainer.share_prefix = False
    mb, loss, grads = whole_batch_loss_and_grads(cfg, tiny_model_dir, batch, columns, loss_fn)
    assert mb.grid_attention_mask is None and mb.forward_tokens == mb.num_tokens
    cfg.trainer.share_prefix = True
    for attention in ("sdpa", "eager"):
        shared_mb, shared_loss, shared_grads = whole_batch_loss_and_grads(cfg, tiny_model_dir, batch, columns,
                                                                          loss_fn, attention)
        assert shared_mb.grid_attention_mask is not None and shared_mb.grid_input_ids.shape[0] == 5  # a row a group
        assert shared_mb.forward_tokens < 0.5 * shared_mb.num_tokens
        assert torch.allclose(shared_loss, loss, atol=1e-6), attention
        for name in grads:
            assert torch.allclose(shared_grads[name], grads[name], atol=1e-6), (attention, name)

    # compute_logp (the proximal/reference pass) and the stats of a whole update agree as well
    def logp_and_update(share: bool):
        cfg.trainer.share_prefix = share
        engine = TrainEngine(str(tiny_model_dir), cfg.trainer, total_steps=4)
        engine.initialize()
        logp = engine.compute_logp(batch)
        stats = engine.train_batch(batch, loss_fn, make_loss(cfg.ppo).weight, columns)
        return logp, stats

    (logp_a, stats_a), (logp_b, stats_b) = logp_and_update(False), logp_and_update(True)
    assert len(logp_a) == len(logp_b) and all(len(a) == len(b) for a, b in zip(logp_a, logp_b))
    assert max(abs(x - y) for a, b in zip(logp_a, logp_b) for x, y in zip(a, b)) < 1e-5
    assert stats_b["forward_tokens"] < 0.5 * stats_a["forward_tokens"] == 0.5 * stats_a["tokens"]
    for key in ("loss", "grad_norm", "entropy", "clip_fraction"):
        assert stats_b[key] == pytest.approx(stats_a[key], rel=1e-4, abs=1e-6), key


def test_one_minibatch_takes_proximal_logprobs_from_its_own_forward(single_process_group, tiny_model_dir, tmp_path):
    """The decoupled loss with one minibatch: the training forward's detached logprobs are the proximal ones, so
    the update equals the one with a separate proximal forward pass (which more minibatches still need)."""
    cfg = trainer_config(tmp_path, "trainer.mb_max_tokens=100000", "rollout.max_head_offpolicyness=1")
    loss_fn, weight_fn, columns, policy_columns = make_loss(cfg.ppo)
    assert "prox_logprobs" in columns and policy_columns == ("prox_logprobs",)
    behaviour_columns = tuple(c for c in columns if c != "prox_logprobs")
    batch = read_batch(make_batch(tiny_model_dir, tmp_path, seed=3, cfg=cfg), ("input_ids",) + behaviour_columns)
    rng = random.Random(0)  # stale behaviour logprobs, so that the behaviour weights are not all 1
    batch["logprobs"] = [[v - rng.random() * m for v, m in zip(lp, mask)]
                         for lp, mask in zip(batch["logprobs"], batch["loss_mask"])]

    def update(prox_from_forward: bool):
        engine = TrainEngine(str(tiny_model_dir), cfg.trainer, total_steps=4)
        engine.initialize()
        data = dict(batch)
        if not prox_from_forward:
            data["prox_logprobs"] = engine.compute_logp(batch)
        stats = engine.train_batch(data, loss_fn, weight_fn, behaviour_columns if prox_from_forward else columns,
                                   forward_logprob_columns=policy_columns if prox_from_forward else ())
        return stats, {k: v.clone() for k, v in engine.full_state_dict().items()}, engine

    (separate, separate_weights, _), (own, own_weights, engine) = update(False), update(True)
    assert own["behave_imp_weight"] == pytest.approx(separate["behave_imp_weight"], rel=1e-5)
    assert own["behave_imp_weight"] > 1.05  # the behaviour weights exp(prox - old) did act
    assert own["importance_weight"] == pytest.approx(1.0, abs=1e-6)
    assert own["loss"] == pytest.approx(separate["loss"], rel=1e-5)
    for name, value in own_weights.items():
        assert torch.allclose(value, separate_weights[name], atol=1e-6), name
    initial = weights(tiny_model_dir)
    assert any(not torch.equal(own_weights[name], initial[name]) for name in initial)  # it did step
    with pytest.raises(ValueError, match="one minibatch"):
        engine.train_batch(batch, loss_fn, weight_fn, behaviour_columns, n_minibatches=2,
                           forward_logprob_columns=policy_columns)


def test_one_rank_full_state_dict_is_the_generic_gather(single_process_group, tiny_model_dir, tmp_path):
    """On one rank the weights are read off the local shards; they are what torch's gather returns."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    cfg = trainer_config(tmp_path)
    loss_fn, weight_fn, columns, _ = make_loss(cfg.ppo)
    engine = TrainEngine(str(tiny_model_dir), cfg.trainer, total_steps=4)
    engine.initialize()
    engine.train_batch(read_batch(make_batch(tiny_model_dir, tmp_path, seed=5, cfg=cfg), ("input_ids",) + columns),
                       loss_fn, weight_fn, columns)
    fast = engine.full_state_dict()
    generic = get_model_state_dict(engine.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    assert fast.keys() == generic.keys()
    for name, value in generic.items():
        assert fast[name].dtype == value.dtype and torch.equal(fast[name], value), name


def test_gradient_checkpointing_gives_the_same_gradients(single_process_group, tiny_model_dir, tmp_path):
    cfg, batch, columns, loss_fn = whole_batch_setup(tmp_path, tiny_model_dir, seed=3)
    results = []
    for checkpointing in (False, True):
        cfg.trainer.gradient_checkpointing = checkpointing
        results.append(whole_batch_loss_and_grads(cfg, tiny_model_dir, batch, columns, loss_fn)[1:])
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.allclose(loss_a, loss_b, atol=1e-6)
    assert all(torch.allclose(grads_a[n], grads_b[n], atol=1e-6) for n in grads_a)
