"""`areal-pipeline export --format adapter|merged|full`: a run's weights from real checkpoints the train engine saved
(a LoRA run with trained-looking adapters, a full fine-tuning run), loaded back by peft and transformers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from areal_pipeline.checksums import IntegrityError
from areal_pipeline.model import build_tiny_model, load_model
from areal_pipeline.training.engine import TrainEngine
from areal_pipeline.weights_export import WeightExportError, export_weights
from _trainer_helpers import single_process_group, trainer_config  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
IDS = torch.tensor([[3, 17, 42, 99, 5, 61, 7, 200, 1]])
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(scope="module")
def runs(single_process_group, tiny_model_dir, tmp_path_factory):  # noqa: F811
    """runs/lora: step_1 (B = 0: the base) and step_2 (every B drawn at random, as after training);
    runs/full: a full fine-tuning run's step_1."""
    output_dir = tmp_path_factory.mktemp("runs")
    cfg = trainer_config(output_dir, "trainer.lora.enabled=true", "trainer.lora.rank=4", "trainer.lora.alpha=8")
    engine = TrainEngine(str(tiny_model_dir), cfg.trainer, total_steps=4, seed=1)
    engine.initialize()
    engine.version = 1
    engine.save(output_dir / "lora" / "checkpoints" / "step_1")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in engine.model.named_parameters():
            if ".lora_B." in name:  # a world of one: the local shard is the whole tensor
                param.to_local().copy_(torch.randn(param.shape, generator=generator) * 0.05)
    engine.version = 2
    engine.save(output_dir / "lora" / "checkpoints" / "step_2")

    full = TrainEngine(str(tiny_model_dir), trainer_config(output_dir).trainer, total_steps=4, seed=1)
    full.initialize()
    full.version = 1
    full.save(output_dir / "full" / "checkpoints" / "step_1")
    return output_dir


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def test_the_adapter_is_the_checkpoints_peft_directory_and_serves_the_trained_policy(runs, tiny_model_dir, tmp_path):
    from peft import PeftModel

    result = export_weights(runs / "lora", tmp_path / "adapter", "adapter")
    assert (result.form, result.step, result.files) == ("adapter", 2, ADAPTER_FILES)
    ckpt = runs / "lora" / "checkpoints" / "step_2"
    assert result.checkpoint == ckpt
    assert result.bytes == sum((tmp_path / "adapter" / name).stat().st_size for name in ADAPTER_FILES)
    for name in ADAPTER_FILES:  # the checkpoint's verified files, byte for byte
        assert (tmp_path / "adapter" / name).read_bytes() == (ckpt / "adapter" / name).read_bytes()
    assert "wrote the LoRA adapter of step 2" in result.describe()

    adapted = logits(PeftModel.from_pretrained(load_model(tiny_model_dir), str(tmp_path / "adapter")))
    policy = logits(load_model(ckpt / "model"))  # the merged policy the trainer served at step 2
    assert torch.allclose(adapted, policy, atol=1e-5)
    assert not torch.allclose(adapted, logits(load_model(tiny_model_dir)), atol=1e-3)  # the adapters do something

    # step 1 by number: the adapters before any update, B = 0
    first = export_weights(runs / "lora", tmp_path / "step1", "adapter", checkpoint="1")
    assert first.step == 1
    saved = load_file(str(tmp_path / "step1" / "adapter_model.safetensors"))
    assert all(not t.any() for name, t in saved.items() if ".lora_B." in name)


def test_the_merged_model_is_peft_merge_of_base_and_adapter(runs, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = runs / "lora" / "checkpoints" / "step_2"
    result = export_weights(runs / "lora", tmp_path / "merged", "merged", checkpoint=str(ckpt))
    assert (result.form, result.step, result.base) == ("merged", 2, str(tiny_model_dir))
    merged, saved = load_file(str(tmp_path / "merged" / "model.safetensors")), load_file(str(ckpt / "model" /
                                                                                          "model.safetensors"))
    assert merged.keys() == saved.keys()
    assert all(torch.allclose(merged[name], saved[name], atol=1e-6, rtol=0) for name in saved)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(result.files)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    assert torch.allclose(logits(model), logits(load_model(ckpt / "model")), atol=1e-5)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "merged"))
    assert tokenizer.decode(tokenizer("12+30=42")["input_ids"]) == "12+30=42"

    # the base named by --base (a copy elsewhere) gives the same weights
    shutil.copytree(tiny_model_dir, tmp_path / "moved-base")
    again = export_weights(runs / "lora", tmp_path / "merged-again", "merged", base=str(tmp_path / "moved-base"))
    assert again.base == str(tmp_path / "moved-base")
    again_state = load_file(str(tmp_path / "merged-again" / "model.safetensors"))
    assert all(torch.equal(again_state[name], merged[name]) for name in merged)


def test_full_is_the_checkpoints_model_directory_and_a_full_run_has_no_adapter(runs, tmp_path):
    lora_full = export_weights(runs / "lora", tmp_path / "lora-full", "full")
    model_dir = runs / "lora" / "checkpoints" / "step_2" / "model"
    assert lora_full.files == tuple(sorted(p.name for p in model_dir.iterdir()))
    assert all((tmp_path / "lora-full" / name).read_bytes() == (model_dir / name).read_bytes()
               for name in lora_full.files)

    model_dir = runs / "full" / "checkpoints" / "step_1" / "model"
    for form in ("merged", "full"):
        result = export_weights(runs / "full", tmp_path / form, form)
        assert (result.form, result.step, result.base) == (form, 1, None)
        assert ((tmp_path / form / "model.safetensors").read_bytes()
                == (model_dir / "model.safetensors").read_bytes())

    with pytest.raises(WeightExportError, match="is a full fine-tuning checkpoint: it has no LoRA adapter.*"
                                                "--format merged or --format full"):
        export_weights(runs / "full", tmp_path / "adapter", "adapter")
    with pytest.raises(WeightExportError, match="--base is for merging a LoRA adapter"):
        export_weights(runs / "full", tmp_path / "base", "merged", base=str(tmp_path))
    assert not (tmp_path / "adapter").exists() and not (tmp_path / "base").exists()


def test_a_corrupt_or_missing_file_is_named_and_nothing_is_written(runs, tmp_path):
    ckpt = tmp_path / "step_2"
    shutil.copytree(runs / "lora" / "checkpoints" / "step_2", ckpt)
    weights = ckpt / "adapter" / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    for form in ("adapter", "merged"):
        with pytest.raises(IntegrityError, match=r"adapter/adapter_model\.safetensors: sha256 mismatch"):
            export_weights(None, tmp_path / "out", form, checkpoint=str(ckpt))
    (ckpt / "adapter" / "adapter_config.json").unlink()
    with pytest.raises(IntegrityError, match=r"adapter/adapter_config\.json: missing file"):
        export_weights(None, tmp_path / "out", "adapter", checkpoint=str(ckpt))
    (ckpt / "checksums.json").unlink()  # a save that never finished
    with pytest.raises(IntegrityError, match="checksums.json: missing manifest"):
        export_weights(None, tmp_path / "out", "full", checkpoint=str(ckpt))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2"]  # no output, no temporary directory


def test_bad_requests_are_refused_before_anything_is_written(runs, tiny_model_dir, tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("keep me")
    with pytest.raises(WeightExportError, match="exists and is not empty"):
        export_weights(runs / "lora", taken, "adapter")
    assert [p.name for p in taken.iterdir()] == ["mine.txt"] and (taken / "mine.txt").read_text() == "keep me"

    (tmp_path / "empty" / "checkpoints" / "step_3").mkdir(parents=True)  # a save that never finished
    with pytest.raises(WeightExportError, match="run 'empty' has no saved checkpoint in"):
        export_weights(tmp_path / "empty", tmp_path / "out", "adapter")
    with pytest.raises(WeightExportError, match="no saved checkpoint of step 7; saved steps: 1, 2"):
        export_weights(runs / "lora", tmp_path / "out", "adapter", checkpoint="7")
    with pytest.raises(WeightExportError, match="no run directory"):
        export_weights(runs / "nope", tmp_path / "out", "adapter")
    with pytest.raises(WeightExportError, match="no checkpoint directory"):
        export_weights(None, tmp_path / "out", "adapter", checkpoint=str(tmp_path / "missing"))
    with pytest.raises(WeightExportError, match="is not a checkpoint directory"):
        export_weights(None, tmp_path / "out", "adapter", checkpoint=str(tiny_model_dir.parent))
    with pytest.raises(WeightExportError, match="unknown weight format 'gguf'"):
        export_weights(runs / "lora", tmp_path / "out", "gguf")
    with pytest.raises(WeightExportError, match=r"the base model '/no/such/base' \(--base\) is not a model "
                                                r"directory.*--base PATH"):
        export_weights(runs / "lora", tmp_path / "out", "merged", base="/no/such/base")

    # a base the adapter does not fit (fewer layers): refused after loading, nothing left behind
    other = build_tiny_model(tmp_path / "other-base", _shallow_tiny())
    with pytest.raises(WeightExportError, match="does not fit the base model"):
        export_weights(runs / "lora", tmp_path / "out", "merged", base=str(other))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "other-base", "taken"]

    # an empty directory is taken as a new one
    (tmp_path / "empty-out").mkdir()
    assert export_weights(runs / "lora", tmp_path / "empty-out", "adapter").files == ADAPTER_FILES


def _shallow_tiny():
    from areal_pipeline.config import TinyModelConfig

    return TinyModelConfig(num_hidden_layers=1)  # the same width: peft alone would only warn


def test_the_command_line(runs, tmp_path):
    cli = str(REPO / ".venv" / "bin" / "areal-pipeline")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = tmp_path / "adapter"
    done = subprocess.run([cli, "export", "--run-id", "lora", "--output-dir", str(runs), "--format", "adapter",
                           "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(f"wrote the LoRA adapter of step 2 to {out}: 2 files")
    assert sorted(p.name for p in out.iterdir()) == list(ADAPTER_FILES)
    assert json.loads((out / "adapter_config.json").read_text())["peft_type"] == "LORA"

    bad = subprocess.run([cli, "export", "--run-id", "full", "--output-dir", str(runs), "--format", "adapter",
                          "--checkpoint", "1", "--out", str(tmp_path / "x")], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1
    assert bad.stderr.strip().splitlines()[-1].startswith("export error: ")
    assert "full fine-tuning checkpoint" in bad.stderr and not (tmp_path / "x").exists()
