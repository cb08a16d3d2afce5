"""trainer.lora in the FSDP train engine (a real gloo world of one, this process): what an update moves, the
policy it serves against peft's own merge, the checkpoint as a PEFT directory and its bitwise resume, the reference
as the base with the adapters off, and the merge math by hand."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from areal_pipeline.model import load_model
from areal_pipeline.training import lora
from areal_pipeline.training.engine import TrainEngine
from areal_pipeline.training.loss_registry import make_loss
from areal_pipeline.training.batches import read_batch
from _trainer_helpers import make_batch, single_process_group, trainer_config, weights  # noqa: F401

LORA = ("trainer.lora.enabled=true", "trainer.lora.rank=4", "trainer.lora.alpha=8",
        "trainer.optimizer.lr=1e-2")  # a rate that moves B well away from 0 in one step


def lora_engine(cfg, model_dir, seed: int = 1) -> TrainEngine:
    engine = TrainEngine(str(model_dir), cfg.trainer, total_steps=4, seed=seed)
    engine.initialize()
    return engine


def one_update(engine: TrainEngine, cfg, batch_dir) -> dict:
    loss_fn, weight_fn, columns, _ = make_loss(cfg.ppo)
    return engine.train_batch(read_batch(batch_dir, ("input_ids",) + columns), loss_fn, weight_fn, columns)


@pytest.fixture
def setup(single_process_group, tiny_model_dir, tmp_path):  # noqa: F811
    cfg = trainer_config(tmp_path, *LORA)
    return cfg, make_batch(tiny_model_dir, tmp_path, seed=3, cfg=cfg)


def test_an_update_moves_the_adapters_only_and_the_optimizer_holds_only_them(setup, tiny_model_dir):
    cfg, batch_dir = setup
    engine = lora_engine(cfg, tiny_model_dir)
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # every linear layer of every decoder block, and nothing else (the output head is not one)
    blocks = len(load_model(tiny_model_dir).model.layers)
    assert len(trainable) == 2 * 7 * blocks
    one_update(engine, cfg, batch_dir)
    after = engine.full_state_dict()
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved and moved <= trainable
    assert any(".lora_B." in n for n in moved)  # B left 0
    optimizer_params = [p for group in engine.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in optimizer_params} == {id(p) for p in engine.trainable_parameters()}
    assert all(id(p) in {id(q) for q in optimizer_params} for p in engine.optimizer.state)


def test_version_0_is_the_base_and_the_adapters_start_from_the_seed_alone(setup, tiny_model_dir):
    cfg, _ = setup
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a, b = lora_engine(cfg, tiny_model_dir, seed=7), lora_engine(cfg, tiny_model_dir, seed=7)
    assert torch.equal(torch.rand(3), expected_next)  # wrapping left the global random state as it was
    other = lora_engine(cfg, tiny_model_dir, seed=8)
    sa, sb, so = a.full_state_dict(), b.full_state_dict(), other.full_state_dict()
    a_names = [n for n in sa if ".lora_A." in n]
    assert all(torch.equal(sa[n], sb[n]) for n in sa)
    assert not all(torch.equal(sa[n], so[n]) for n in a_names)
    base = weights(tiny_model_dir)
    policy = a.policy_state_dict()
    assert policy.keys() >= base.keys() and all(torch.equal(policy[n], base[n]) for n in base)


def test_the_served_policy_and_the_checkpoint_are_what_peft_loads_and_merges(setup, tiny_model_dir, tmp_path):
    from peft import PeftModel

    cfg, batch_dir = setup
    engine = lora_engine(cfg, tiny_model_dir)
    one_update(engine, cfg, batch_dir)
    engine.save(tmp_path / "ckpt")
    adapter_dir = tmp_path / "ckpt" / lora.ADAPTER_SUBDIR
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    assert config["base_model_name_or_path"] == str(tiny_model_dir)
    peft_model = PeftModel.from_pretrained(load_model(tiny_model_dir), str(adapter_dir))
    ids = torch.tensor([[3, 17, 42, 99, 5, 61, 7]])
    with torch.no_grad():
        adapted = peft_model(ids).logits
        merged = peft_model.merge_and_unload()
        merged_state = merged.state_dict()
    policy = engine.policy_state_dict()
    assert policy.keys() == merged_state.keys()
    assert all(torch.equal(policy[n], merged_state[n]) for n in policy)  # computed as peft computes it
    saved = weights(tmp_path / "ckpt" / "model")
    assert all(torch.equal(saved[n], merged_state[n]) for n in saved)
    served = load_model(tmp_path / "ckpt" / "model")
    with torch.no_grad():
        assert torch.allclose(served(ids).logits, adapted, atol=1e-5)
        assert not torch.allclose(load_model(tiny_model_dir)(ids).logits, adapted, atol=1e-3)
    state = json.loads((tmp_path / "ckpt" / "trainer_state.json").read_text())
    assert state["lora"] == {"rank": 4, "alpha": 8.0, "target_modules": ["all-linear"], "use_rslora": False}
    # the optimizer's state is the adapters' alone
    names = {k.rsplit("::", 1)[0] for k in load_file(str(tmp_path / "ckpt" / "optimizer.safetensors"))}
    assert names == {n for n, p in engine.model.named_parameters() if p.requires_grad}


def test_a_resumed_checkpoint_continues_bitwise_and_other_settings_are_refused(setup, tiny_model_dir, tmp_path):
    cfg, batch_dir = setup
    engine = lora_engine(cfg, tiny_model_dir)
    one_update(engine, cfg, batch_dir)
    engine.version = 1  # as the trainer labels it
    engine.save(tmp_path / "ckpt")
    one_update(engine, cfg, batch_dir)
    straight = engine.full_state_dict()
    resumed = lora_engine(cfg, tiny_model_dir, seed=99)  # another seed's adapters: the checkpoint's replace them
    resumed.load(tmp_path / "ckpt")
    assert resumed.version == 1
    one_update(resumed, cfg, batch_dir)
    again = resumed.full_state_dict()
    assert straight.keys() == again.keys() and all(torch.equal(straight[n], again[n]) for n in straight)

    other_rank = lora_engine(trainer_config(tmp_path, *LORA, "trainer.lora.rank=8"), tiny_model_dir)
    with pytest.raises(lora.LoRAMismatchError, match=r"trainer.lora.rank=4 \(this trainer: 8\)"):
        other_rank.load(tmp_path / "ckpt")
    full = TrainEngine(str(tiny_model_dir), trainer_config(tmp_path).trainer, total_steps=4)
    full.initialize()
    with pytest.raises(lora.LoRAMismatchError, match="holds LoRA adapters"):
        full.load(tmp_path / "ckpt")
    full.save(tmp_path / "full")
    with pytest.raises(lora.LoRAMismatchError, match="full fine-tuning one"):
        lora_engine(cfg, tiny_model_dir).load(tmp_path / "full")


def test_the_reference_is_the_base_with_the_adapters_off(setup, tiny_model_dir, tmp_path):
    cfg, batch_dir = setup
    batch = read_batch(batch_dir, ("input_ids",))
    reference = TrainEngine(str(tiny_model_dir), trainer_config(tmp_path).trainer, total_steps=4, trainable=False)
    reference.initialize()
    expected = reference.compute_logp(batch)
    engine = lora_engine(cfg, tiny_model_dir)
    for _ in range(2):
        one_update(engine, cfg, batch_dir)
    with engine.model.disable_adapter():
        base = engine.compute_logp(batch)
    assert base == expected  # bitwise: the same base weights, the same kernels
    actor = engine.compute_logp(batch)
    assert max(abs(x - y) for a, b in zip(actor, expected) for x, y in zip(a, b)) > 1e-3


def test_merged_state_by_hand():
    cfg = type("L", (), {"rank": 2, "alpha": 3.0, "use_rslora": False})()
    w, a, b = torch.ones(3, 4), torch.arange(8.0).reshape(2, 4), torch.arange(6.0).reshape(3, 2)
    state = {"base_model.model.layer.base_layer.weight": w, "base_model.model.layer.lora_A.default.weight": a,
             "base_model.model.layer.lora_B.default.weight": b, "base_model.model.norm.weight": torch.ones(4)}
    merged = lora.merged_state(state, cfg)
    assert sorted(merged) == ["layer.weight", "norm.weight"]
    # row 0 of B A is 0 * a[0] + 1 * a[1] = [4, 5, 6, 7]; scaled by alpha / rank = 1.5, plus 1
    assert merged["layer.weight"][0].tolist() == [7.0, 8.5, 10.0, 11.5]
    rs = type("L", (), {"rank": 4, "alpha": 4.0, "use_rslora": True})()
    assert lora.scaling(rs) == 2.0 and lora.scaling(cfg) == 1.5
    assert lora.peft_state(state).keys() == {"base_model.model.layer.lora_A.weight",
                                             "base_model.model.layer.lora_B.weight"}
    with pytest.raises(lora.LoRAMismatchError, match="missing"):
        lora.module_state({"base_model.model.layer.lora_A.weight": a}, list(state))


def test_what_a_push_sends_follows_the_backend_and_an_impossible_adapter_push_is_refused():
    from areal_pipeline.config import ConfigError, adapter_push
    from areal_pipeline.run_spec import load_config

    vllm = ["trainer.lora.enabled=true", "inference.backend=vllm", "model.tiny.num_attention_heads=2"]
    assert adapter_push(load_config(None, vllm))  # auto: the adapter alone to vLLM servers the run launches
    assert not adapter_push(load_config(None, [*vllm, "inference.addresses=[127.0.0.1:1]"]))  # theirs: merged
    assert not adapter_push(load_config(None, [*vllm, "trainer.lora.push=merged"]))
    lora = ["trainer.lora.enabled=true"]
    assert adapter_push(load_config(None, lora))  # the project's server: through SGLang's /load_lora_adapter
    assert adapter_push(load_config(None, [*lora, "inference.backend=sglang"]))
    assert not adapter_push(load_config(None, [*lora, "inference.backend=sglang", "inference.sglang.dp_size=2"]))
    assert not adapter_push(load_config(None, [*lora, "trainer.weight_sync=distributed"]))
    assert not adapter_push(load_config(None, vllm[1:]))  # no LoRA
    with pytest.raises(ConfigError, match=r"trainer.lora.push='adapter': needs trainer.weight_sync=disk \(got "
                                          r"'distributed'\)"):
        load_config(None, [*lora, "trainer.lora.push=adapter", "trainer.weight_sync=distributed"])
    with pytest.raises(ConfigError, match=r"trainer.lora.push='adapter': SGLang loads adapters at run time only with "
                                          r"one data-parallel replica"):
        load_config(None, [*lora, "trainer.lora.push=adapter", "inference.backend=sglang",
                           "inference.sglang.dp_size=2"])
    with pytest.raises(ConfigError, match="trainer.lora.push='both': must be one of auto, adapter, merged"):
        load_config(None, ["trainer.lora.push=both"])


def test_a_bfloat16_base_stays_frozen_under_float32_adapters_and_merges_as_peft_does(single_process_group,  # noqa: F811
                                                                                    tiny_model_dir, tmp_path):
    """trainer.lora.base_dtype=bfloat16 (what auto picks on CUDA): the base is stored in 16 bits and never moves, the
    adapters are float32 and trained (FSDP2 takes the mixed storage: it asks a uniform dtype of the trained
    parameters only), and the served policy is the base's dtype, bitwise what peft's merge gives on that model."""
    from peft import PeftModel

    cfg = trainer_config(tmp_path, *LORA, "trainer.lora.base_dtype=bfloat16")
    batch_dir = make_batch(tiny_model_dir, tmp_path, seed=3, cfg=cfg)
    engine = lora_engine(cfg, tiny_model_dir)
    dtypes = {n: p.dtype for n, p in engine.model.named_parameters()}
    assert {d for n, d in dtypes.items() if ".lora_" in n} == {torch.float32}
    assert {d for n, d in dtypes.items() if ".lora_" not in n} == {torch.bfloat16}
    before = {k: v.clone() for k, v in engine.full_state_dict().items()}
    one_update(engine, cfg, batch_dir)
    after = engine.full_state_dict()
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved and all(".lora_" in n for n in moved)
    engine.save_adapter(tmp_path / "adapter")
    policy = engine.policy_state_dict()
    reference = PeftModel.from_pretrained(load_model(str(tiny_model_dir), dtype="bfloat16"), str(tmp_path / "adapter"),
                                          autocast_adapter_dtype=True).merge_and_unload().state_dict()
    assert {t.dtype for t in policy.values()} == {torch.bfloat16}
    assert all(torch.equal(policy[n], reference[n]) for n in reference), "not peft's merge"
