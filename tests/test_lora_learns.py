"""trainer.lora through the real pipeline (the project's servers, the torchrun trainer, real shards): the CPU default
with LoRA learns; every push sends the adapter alone, which the server merges into its base and which is verified
there; the base never moves; the reference logprobs are the base's while the actor has moved away from it.

By hand (seed 1, the default's warm-started base, 30 iterations, lr 3e-3; 1e-2 is noisier, 3e-2 collapses): the
batch reward goes from ~0.35 over the first iterations to ~0.75 over the last five."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file

from _learning_helpers import first_and_last, short_run
from areal_pipeline.data.shards import read_table
from areal_pipeline.model import load_model
from areal_pipeline.run_dir import RunPaths

LORA = ("trainer.lora.enabled=true", "trainer.optimizer.lr=3e-3")


def test_the_default_learns_with_lora_by_adapter_pushes(default_base_model, tmp_path):
    cfg, records = short_run("tiny_cpu.yaml", tmp_path, f"model.path={default_base_model}", "total_iterations=30",
                             "save_freq=30", *LORA)
    curve = [round(r["reward_mean"], 2) for r in records]
    first, _ = first_and_last(records, "reward_mean", 3)
    _, last = first_and_last(records, "reward_mean", 5)
    assert last > first + 0.2, curve
    checkpoint = RunPaths(cfg.run_dir).checkpoint(30)
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["lora"]["rank"] == 8 and (checkpoint / "adapter" / "adapter_model.safetensors").is_file()
    # only the adapter travelled: the last push's directory is a PEFT adapter, a fraction of the model's bytes
    pushed = Path(cfg.run_dir) / "weights" / "v30"
    assert sorted(p.name for p in pushed.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    model_bytes = (Path(default_base_model) / "model.safetensors").stat().st_size
    assert (pushed / "adapter_model.safetensors").stat().st_size < model_bytes / 4
    # the policy the checkpoint holds (what the server merged, and verified at every push): adapted layers moved
    served = load_file(str(checkpoint / "model" / "model.safetensors"))
    base = load_file(str(Path(default_base_model) / "model.safetensors"))
    assert served.keys() == base.keys()
    moved = {n for n in base if not torch.equal(served[n], base[n])}
    assert moved and all(n.endswith("_proj.weight") for n in moved), sorted(moved)[:5]


def test_the_reference_is_the_base_while_the_lora_actor_moves(default_base_model, tmp_path):
    cfg, records = short_run("tiny_cpu.yaml", tmp_path, f"model.path={default_base_model}", "total_iterations=3",
                             "ppo.kl_ctl=0.05", "rollout.batch_size=8", *LORA, "trainer.optimizer.lr=1e-2")
    paths = RunPaths(cfg.run_dir)
    ref = pq.read_table(paths.iteration(3) / "ref_logprobs.parquet").column("logprobs").to_pylist()
    ids = read_table(paths.rollout(3), schema=None).column("input_ids").to_pylist()  # the rows the trainer read
    base = load_model(default_base_model)
    with torch.no_grad():
        for row, values in list(zip(ids, ref))[:4]:
            logits = base(torch.tensor([row])).logits[0, :-1]
            expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(row[1:])[:, None])[:, 0]
            assert torch.allclose(torch.tensor(values[1:]), expected, atol=1e-5)
    # and the actor is not the base any more: the KL it is held to has grown from the base's own (0, as estimated
    # from sampled tokens: within rounding of it either way)
    kl = [r["kl"] for r in records]
    assert abs(kl[0]) < 1e-5 and kl[-1] > kl[1] > 1e-3, kl


def test_an_adapter_push_the_server_does_not_take_fails_the_run_at_that_push(default_base_model, tmp_path,
                                                                            monkeypatch):
    """At version 3 the server is sent version 2's adapter under version 3's name (it keeps the old policy): the
    probe after the push sees it, and the run stops there, naming the backend, the server, the adapter and the
    version. The pushes before it each loaded the version's adapter alone."""
    from areal_pipeline.inference.client import RemoteSGLangEngine
    from areal_pipeline.inference.weight_check import WeightMismatchError

    loaded: list[tuple[int, str]] = []
    push = RemoteSGLangEngine.update_weights_from_disk

    async def keeps_the_previous_adapter_at_3(engine, path, version):
        loaded.append((version, engine.adapter.name_for(version)))
        await push(engine, str(Path(path).with_name("v2")) if version == 3 else path, version)
    monkeypatch.setattr(RemoteSGLangEngine, "update_weights_from_disk", keeps_the_previous_adapter_at_3)
    with pytest.raises(WeightMismatchError) as failed:
        short_run("tiny_cpu.yaml", tmp_path, f"model.path={default_base_model}", "total_iterations=4",
                  "rollout.batch_size=8", *LORA, "trainer.optimizer.lr=1e-2")
    assert [v for v, _ in loaded] == [1, 2, 3]  # version 0 is the base the servers start on: nothing to push
    error = failed.value
    assert (error.backend, error.version) == ("cpu", 3)
    assert "the LoRA adapter the server serves as 'policy-v3' is not the trainer's" in str(error)
    assert re.search(r"cpu server 127\.0\.0\.1:\d+", str(error))
