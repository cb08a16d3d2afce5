"""The trainer: real torchrun processes (gloo on CPU), real checkpoints, real weight broadcast to a CPU server."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from areal_pipeline.config import load_config
from areal_pipeline.data.shards import write_shards
from areal_pipeline.data.trajectory import Trajectory
from areal_pipeline.model import load_model
from areal_pipeline.training.client import TrainerError, launch_trainer
from areal_pipeline.training.engine import TrainEngine, lr_lambda
from areal_pipeline.training.losses import gather_logprobs
from areal_pipeline.training.loss_registry import make_loss
from areal_pipeline.training.packing import unpack
from areal_pipeline.training.ppo import read_batch, write_batch
from areal_pipeline.utils import find_free_port
from conftest import http, start_cpu_server


# Behaviour logprob = the model's + STALENESS[j % 4] on completion token j: PPO ratios exp(-offset) of 0.61 and
# 1.65 lie outside [0.8, 1.2] (a known share clipped on each side), 0.90 and 1.11 inside; all far enough from the
# bounds that no rounding moves a token across one. A batch of the model's own logprobs has ratio 1 everywhere,
# where the normalised advantages make every PPO loss about 0 whatever the engine computes.
STALENESS = (0.5, -0.5, 0.1, -0.1)


def make_batch(model_dir: Path, out: Path, seed: int, cfg, **rollout) -> Path:
    """`make_rollout`'s rollout turned into a batch by the advantages step."""
    write_batch(make_rollout(model_dir, out, seed, **rollout), out / "batch", cfg.ppo, run_id="t", iteration=0)
    return out / "batch"


def make_rollout(model_dir: Path, out: Path, seed: int, n_prompts: int = 6, group: int = 4,
                 prompt_lengths=(3, 12), completion_lengths=(1, 20), completion_vocab: int = 256,
                 staleness: tuple[float, ...] = STALENESS) -> Path:
    """Rollout shards of random completions with stale behaviour logprobs (`staleness`; () for the model's
    own)."""
    rng = random.Random(seed)
    model = load_model(model_dir)
    trajectories = []
    for p in range(n_prompts):
        prompt = [rng.randrange(256) for _ in range(rng.randrange(*prompt_lengths))]
        for k in range(group):
            completion = [rng.randrange(completion_vocab) for _ in range(rng.randrange(*completion_lengths))]
            ids = prompt + completion
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0]
            lp = gather_logprobs(logits[:-1], torch.tensor(ids[1:])).tolist()
            n = len(prompt)
            trajectories.append(Trajectory(
                prompt_id=f"p{p}", group_id=f"p{p}", sample_idx=k, input_ids=ids,
                loss_mask=[0] * n + [1] * len(completion),
                logprobs=[0.0] * n + [v + stale_offset(j, staleness) for j, v in enumerate(lp[n - 1:])],
                versions=[-1] * n + [0] * len(completion), reward=float(rng.random() < 0.5),
                stop_reason="stop"))
    write_shards(trajectories, out / "rollout", run_id="t", iteration=0)
    return out / "rollout"


def stale_offset(j: int, staleness: tuple[float, ...] = STALENESS) -> float:
    """What make_batch adds to the model's logprob of completion token j."""
    return staleness[j % len(staleness)] if staleness else 0.0


def trainer_config(tmp_path: Path, *overrides: str):
    return load_config(None, [f"output_dir={tmp_path}", "trainer.optimizer.lr=1e-3", "total_iterations=4",
                              "trainer.mb_max_tokens=96", *overrides])


def hand_ppo_loss(logprobs, old_logprobs, advantages, loss_mask, eps_clip: float) -> tuple[float, float]:
    """PPO's clipped objective written out token by token over per-sequence lists: (token-mean loss over the
    mask, share of the masked tokens where the clipped term wins)."""
    total, clipped, count = 0.0, 0, 0
    for lp_row, old_row, adv_row, mask_row in zip(logprobs, old_logprobs, advantages, loss_mask):
        for lp, old, adv, m in zip(lp_row, old_row, adv_row, mask_row):
            if not m:
                continue
            ratio = math.exp(lp - old)
            unclipped, bounded = -adv * ratio, -adv * min(max(ratio, 1 - eps_clip), 1 + eps_clip)
            total += max(unclipped, bounded)
            clipped += bounded > unclipped
            count += 1
    return total / count, clipped / count


def plain_logprobs(model_dir: Path, sequences: list[list[int]]) -> list[list[float]]:
    """Each sequence's per-token logprobs (0 at its first token) from one ordinary forward of the unsharded model."""
    model = load_model(model_dir)
    out = []
    with torch.no_grad():
        for ids in sequences:
            logits = model(torch.tensor([ids])).logits[0]
            out.append([0.0] + gather_logprobs(logits[:-1], torch.tensor(ids[1:])).tolist())
    return out


def weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "model.safetensors"))


def test_lr_schedules():
    assert [lr_lambda("constant", 10, 2, 0.0)(s) for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    linear = lr_lambda("linear", 10, 0, 0.1)
    assert linear(0) == 1.0 and linear(5) == pytest.approx(0.1 + 0.9 * 0.5) and linear(10) == pytest.approx(0.1)
    cosine = lr_lambda("cosine", 12, 2, 0.0)
    assert cosine(1) == 1.0 and cosine(7) == pytest.approx(0.5) and cosine(12) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="valid: constant, linear, cosine"):
        lr_lambda("step", 1, 0, 0)


@pytest.fixture(scope="module")
def single_process_group():
    """This test process as a world of one (real gloo), for in-process engine checks."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{find_free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


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


@pytest.fixture(scope="module")
def batches(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("batches")
    cfg = trainer_config(root)
    # prompts longer than most answers: the trainer lays most groups out around their shared prompt
    return [make_batch(tiny_model_dir, root / f"b{k}", seed=k, cfg=cfg, prompt_lengths=(10, 24),
                       completion_lengths=(1, 12)) for k in range(4)]


def run_updates(cfg, model_dir, batch_dirs, first_iteration, out: Path, load=None, save_at=None, nproc=1):
    cfg.trainer.nproc = nproc
    process, client = launch_trainer(cfg, str(model_dir), out / f"logs-{nproc}")
    try:
        if load is not None:
            assert client.call("load", path=str(load))["version"] == first_iteration - 1
        stats = []
        for k, batch_dir in enumerate(batch_dirs, start=first_iteration):
            stats.append(client.call("train", batch_dir=str(batch_dir), iteration=k)["stats"])
            if k == save_at:
                client.call("save", path=str(out / f"ckpt-{k}"))
        client.call("save_weights", path=str(out / "final"))
        return stats
    finally:
        process.stop()


def test_two_ranks_give_the_same_update_as_one(tiny_model_dir, batches, tmp_path):
    cfg = trainer_config(tmp_path, "ppo.ppo_n_minibatches=2")
    one = run_updates(cfg, tiny_model_dir, batches[:2], 1, tmp_path / "one", nproc=1)
    two = run_updates(cfg, tiny_model_dir, batches[:2], 1, tmp_path / "two", nproc=2)
    # The pre-clip gradient norm is what a weighting bug would change (Adam normalises a uniform scale away).
    for a, b in zip(one, two):
        for key in ("loss", "grad_norm", "clip_fraction", "approx_kl", "entropy", "loss_weight"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    w1, w2 = weights(tmp_path / "one" / "final"), weights(tmp_path / "two" / "final")
    assert w1.keys() == w2.keys()
    # Adam turns fp32 reduction-order noise on near-zero gradients into lr-sized steps on a few elements:
    # measured max |diff| 5.7e-5 on 4 of 822k elements, against updates of up to 4e-3.
    for name in w1:
        assert torch.allclose(w1[name], w2[name], atol=1e-4), name
    initial = weights(tiny_model_dir)
    assert not torch.equal(initial["model.norm.weight"], w1["model.norm.weight"])  # it did train


def test_resume_from_checkpoint_is_bitwise_exact(tiny_model_dir, batches, tmp_path):
    cfg = trainer_config(tmp_path, "trainer.optimizer.lr_scheduler_type=cosine",
                         "trainer.optimizer.warmup_steps_proportion=0.25")
    straight = run_updates(cfg, tiny_model_dir, batches, 1, tmp_path / "straight", save_at=2)
    resumed = run_updates(cfg, tiny_model_dir, batches[2:], 3, tmp_path / "resumed",
                          load=tmp_path / "straight" / "ckpt-2")
    assert [s["lr"] for s in straight[2:]] == [s["lr"] for s in resumed]
    a, b = weights(tmp_path / "straight" / "final"), weights(tmp_path / "resumed" / "final")
    assert all(torch.equal(a[name], b[name]) for name in a)
    ckpt = tmp_path / "straight" / "ckpt-2"
    # the model part of a checkpoint is an ordinary Hugging Face directory
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ckpt / "model")
    assert {"optimizer.safetensors", "trainer_state.json"} <= {p.name for p in ckpt.iterdir()}


def test_version_guard_and_command_errors(tiny_model_dir, batches, tmp_path, monkeypatch):
    cfg = trainer_config(tmp_path)
    # and the profiler tables of chosen updates (AREAL_TRAINER_PROFILE), here iteration 1's only
    monkeypatch.setenv("AREAL_TRAINER_PROFILE", str(tmp_path / "profile"))
    monkeypatch.setenv("AREAL_TRAINER_PROFILE_ITERATIONS", "1,7")
    process, client = launch_trainer(cfg, str(tiny_model_dir), tmp_path / "logs")
    try:
        with pytest.raises(TrainerError) as err:
            client.call("train", batch_dir=str(batches[0]), iteration=3)
        assert err.value.code == "version_mismatch" and err.value.details["version"] == 0
        with pytest.raises(TrainerError, match="unknown command"):
            client.call("fly")
        with pytest.raises(TrainerError) as err:
            client.call("load", path=str(tmp_path / "nothing"))
        assert err.value.code == "no_checkpoint"
        with pytest.raises(TrainerError, match="bad arguments"):
            client.call("train", batchdir="x")
        assert client.health()["version"] == 0  # still serving
        assert client.call("train", batch_dir=str(batches[0]), iteration=1)["version"] == 1
        assert client.call("train", batch_dir=str(batches[1]), iteration=2)["version"] == 2
        [table] = (tmp_path / "profile").iterdir()
        assert table.name == "train-iter1-rank0.txt" and "aten::mm" in table.read_text()
    finally:
        process.stop()


def server_logprobs(address: str, ids: list[int]) -> torch.Tensor:
    status, reply = http(address, "/generate", {"input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
                                                 "sampling_params": {"max_new_tokens": 1}})
    assert status == 200
    return torch.tensor([e[0] for e in reply["meta_info"]["input_token_logprobs"][1:]])


def local_logprobs(model_dir: Path, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = load_model(model_dir)(torch.tensor([ids])).logits[0]
    return gather_logprobs(logits[:-1], torch.tensor(ids[1:]))


def test_weight_broadcast_from_disk_and_distributed(tiny_model_dir, batches, tmp_path):
    server = start_cpu_server(tiny_model_dir, tmp_path)
    cfg = trainer_config(tmp_path)
    process, client = launch_trainer(cfg, str(tiny_model_dir), tmp_path / "logs")
    ids = list(range(60, 100))
    try:
        before = server_logprobs(server.address, ids)
        # (a) disk: an HF directory of safetensors, then /update_weights_from_disk
        client.call("train", batch_dir=str(batches[0]), iteration=1)
        client.call("save_weights", path=str(tmp_path / "v1"))
        status, reply = http(server.address, "/update_weights_from_disk",
                             {"model_path": str(tmp_path / "v1"), "weight_version": "1"})
        assert status == 200 and reply["success"]
        after_disk = server_logprobs(server.address, ids)
        assert not torch.allclose(before, after_disk, atol=1e-4)
        assert torch.allclose(after_disk, local_logprobs(tmp_path / "v1", ids), atol=1e-4)

        # (b) distributed: the trainer broadcasts as rank 0 of a gloo group the server joins
        client.call("train", batch_dir=str(batches[1]), iteration=2)
        for _ in range(2):  # the second push reuses the group
            reply = client.call("update_weights_distributed", servers=[server.address],
                                master_address="127.0.0.1", master_port=find_free_port())
            assert reply["version"] == 2
        assert http(server.address, "/get_model_info")[1]["weight_version"] == "2"
        client.call("save_weights", path=str(tmp_path / "v2"))
        after_dist = server_logprobs(server.address, ids)
        assert torch.allclose(after_dist, local_logprobs(tmp_path / "v2", ids), atol=1e-4)
        assert not torch.allclose(after_dist, after_disk, atol=1e-4)
    finally:
        process.stop()
        server.stop()


def test_reinforce_update_through_the_same_engine(tiny_model_dir, tmp_path):
    cfg = trainer_config(tmp_path, "ppo.loss=reinforce", "ppo.adv_norm.mean_level=none",
                         "ppo.adv_norm.std_level=none")
    batch_dir = make_batch(tiny_model_dir, tmp_path, seed=5, cfg=cfg)
    batch = read_batch(batch_dir, ("input_ids", "loss_mask", "advantages"))
    mask = torch.tensor([m for row in batch["loss_mask"] for m in row], dtype=torch.float32)
    adv = torch.tensor([a for row in batch["advantages"] for a in row])
    # the policy's before the update (the batch's behaviour logprobs are stale, and REINFORCE does not read them)
    logp = torch.tensor([lp for row in plain_logprobs(tiny_model_dir, batch["input_ids"]) for lp in row])
    expected = -(adv * logp * mask).sum() / mask.sum()
    process, client = launch_trainer(cfg, str(tiny_model_dir), tmp_path / "logs")
    try:
        stats = client.call("train", batch_dir=str(batch_dir), iteration=1)["stats"]
        client.call("save_weights", path=str(tmp_path / "after"))
    finally:
        process.stop()
    assert stats["loss"] == pytest.approx(float(expected), abs=1e-5)
    assert {"logprob", "advantage", "grad_norm", "lr", "entropy", "tokens_per_s"} <= set(stats)
    a, b = weights(tiny_model_dir), weights(tmp_path / "after")
    assert not torch.equal(a["model.norm.weight"], b["model.norm.weight"])


def test_gradient_checkpointing_gives_the_same_gradients(single_process_group, tiny_model_dir, tmp_path):
    cfg, batch, columns, loss_fn = whole_batch_setup(tmp_path, tiny_model_dir, seed=3)
    results = []
    for checkpointing in (False, True):
        cfg.trainer.gradient_checkpointing = checkpointing
        results.append(whole_batch_loss_and_grads(cfg, tiny_model_dir, batch, columns, loss_fn)[1:])
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.allclose(loss_a, loss_b, atol=1e-6)
    assert all(torch.allclose(grads_a[n], grads_b[n], atol=1e-6) for n in grads_a)


def test_trainer_threads_leave_the_cpu_inference_servers_their_cores(tmp_path):
    from areal_pipeline.training.trainer_server import trainer_threads

    def threads(*overrides: str, cores: int = 2, device: str = "cpu") -> int:
        cfg = load_config(None, [f"output_dir={tmp_path}", "inference.backend=cpu", *overrides])
        return trainer_threads(cfg, torch.device(device), cores=cores)

    asynchronous = "rollout.max_head_offpolicyness=1"
    assert threads() == 0  # synchronous: the update runs alone, torch's default (every core)
    assert threads(asynchronous, "inference.num_threads=1") == 1
    assert threads(asynchronous, "inference.num_threads=4", "inference.num_servers=2", cores=16) == 8
    assert threads(asynchronous, "inference.num_threads=4", "inference.num_servers=2", "trainer.nproc=2",
                   cores=16) == 4
    assert threads(asynchronous, "inference.num_threads=0") == 1  # servers on every core: still one thread
    assert threads(asynchronous, "trainer.num_threads=3") == 3  # set explicitly: as set
    assert threads(asynchronous, "inference.num_threads=1", device="cuda") == 0
