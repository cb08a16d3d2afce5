"""The trainer: real torchrun processes (gloo on CPU), real checkpoints, real weight broadcast to a CPU server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areal_pipeline.model import load_model
from areal_pipeline.run_spec import load_config
from areal_pipeline.training.client import TrainerError, launch_trainer
from areal_pipeline.training.engine import lr_lambda
from areal_pipeline.training.losses import gather_logprobs
from areal_pipeline.training.batches import read_batch
from areal_pipeline.utils import find_free_port
from _trainer_helpers import make_batch, plain_logprobs, trainer_config, weights  # noqa: F401 (weights: test_integrity)
from conftest import http, start_cpu_server


def test_lr_schedules():
    assert [lr_lambda("constant", 10, 2, 0.0)(s) for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    linear = lr_lambda("linear", 10, 0, 0.1)
    assert linear(0) == 1.0 and linear(5) == pytest.approx(0.1 + 0.9 * 0.5) and linear(10) == pytest.approx(0.1)
    cosine = lr_lambda("cosine", 12, 2, 0.0)
    assert cosine(1) == 1.0 and cosine(7) == pytest.approx(0.5) and cosine(12) == pytest.approx(0.0)
    with pytest.raises(ValueError, match="valid: constant, linear, cosine"):
        lr_lambda("step", 1, 0, 0)


@pytest.fixture(scope="module")
def batches(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("batches")
    cfg = trainer_config(root)
    # prompts longer than most answers: the trainer lays most groups out around their shared prompt
    return [make_batch(tiny_model_dir, root / f"b{k}", seed=k, cfg=cfg, prompt_lengths=(10, 24),
                       completion_lengths=(1, 12)) for k in range(4)]


def config(tmp_path: Path, batches: list[Path], *overrides: str):
    """The trainer's config for a test: its output_dir the test's own, and the module's batches (made once, outside
    it) in a second directory the trainer may read, as trainer.weights_dir is (confined_paths.py)."""
    return trainer_config(tmp_path, f"trainer.weights_dir={os.path.commonpath(batches)}", *overrides)


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
        if cfg.trainer.lora.enabled:  # what an adapter push sends: the adapters alone, gathered from every rank
            client.call("save_adapter", path=str(out / "adapter"))
        return stats
    finally:
        process.stop()


def test_two_ranks_give_the_same_update_as_one(tiny_model_dir, batches, tmp_path):
    cfg = config(tmp_path, batches, "ppo.ppo_n_minibatches=2")
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


LORA = ("trainer.lora.enabled=true", "trainer.lora.rank=4", "trainer.optimizer.lr=1e-2")


def test_two_ranks_give_the_same_lora_update_as_one_and_move_only_what_the_adapters_merge_into(
        tiny_model_dir, batches, tmp_path):
    cfg = config(tmp_path, batches, "ppo.ppo_n_minibatches=2", *LORA)
    one = run_updates(cfg, tiny_model_dir, batches[:2], 1, tmp_path / "one", nproc=1)
    two = run_updates(cfg, tiny_model_dir, batches[:2], 1, tmp_path / "two", nproc=2)
    for a, b in zip(one, two):
        for key in ("loss", "grad_norm", "clip_fraction", "approx_kl", "entropy", "loss_weight"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
    # the pushed weights are the merged policy: the adapted layers moved, everything else is the base, bitwise
    w1, w2, initial = weights(tmp_path / "one" / "final"), weights(tmp_path / "two" / "final"), weights(tiny_model_dir)
    assert w1.keys() == w2.keys() == initial.keys()
    for name in w1:
        assert torch.allclose(w1[name], w2[name], atol=1e-4), name
    adapted = {n for n in initial if n.endswith("_proj.weight")}
    assert all(not torch.equal(w1[n], initial[n]) for n in adapted)
    assert all(torch.equal(w1[n], initial[n]) and torch.equal(w2[n], initial[n]) for n in initial if n not in adapted)
    # the adapter a push sends, gathered from the two ranks' shards, is one rank's
    a1, a2 = (load_file(str(tmp_path / run / "adapter" / "adapter_model.safetensors")) for run in ("one", "two"))
    assert a1.keys() == a2.keys() and len(a1) == 2 * len(adapted)
    assert all(torch.allclose(a1[n], a2[n], atol=1e-4) for n in a1)
    assert sorted(p.name for p in (tmp_path / "two" / "adapter").iterdir()) == ["adapter_config.json",
                                                                                "adapter_model.safetensors"]


def test_a_lora_checkpoint_resumes_bitwise_through_the_trainer_and_other_settings_get_409(
        tiny_model_dir, batches, tmp_path):
    cfg = config(tmp_path, batches, *LORA)
    run_updates(cfg, tiny_model_dir, batches, 1, tmp_path / "straight", save_at=2)
    run_updates(cfg, tiny_model_dir, batches[2:], 3, tmp_path / "resumed", load=tmp_path / "straight" / "ckpt-2")
    a, b = weights(tmp_path / "straight" / "final"), weights(tmp_path / "resumed" / "final")
    assert all(torch.equal(a[name], b[name]) for name in a)
    other = config(tmp_path, batches, *LORA, "trainer.lora.alpha=32")
    process, client = launch_trainer(other, str(tiny_model_dir), tmp_path / "logs-other")
    try:
        with pytest.raises(TrainerError, match=r"trainer.lora.alpha=16.0 \(this trainer: 32.0\)") as refused:
            client.call("load", path=str(tmp_path / "straight" / "ckpt-2"))
        assert refused.value.status == 409 and refused.value.code == "lora_mismatch"
    finally:
        process.stop()


def test_resume_from_checkpoint_is_bitwise_exact(tiny_model_dir, batches, tmp_path):
    cfg = config(tmp_path, batches, "trainer.optimizer.lr_scheduler_type=cosine",
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
    cfg = config(tmp_path, batches)
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
    cfg = config(tmp_path, batches)
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


def test_trainer_threads_leave_the_cpu_inference_servers_their_cores(tmp_path):
    from areal_pipeline.training.nodes import trainer_threads

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
