"""trainer.lora: peft's LoRA adapters over a frozen base (docs/lora.md).

The engine wraps the loaded model here before FSDP2 shards it; everything else it needs of an adapted model is a
function of its state dict, named as the wrapped module names it (`base_model.model.<hf name>` with
`<layer>.base_layer.weight` and `<layer>.lora_A.default.weight` beside it):
- the policy the servers serve and the checkpoints' `model/` hold: the base with every adapter merged in, under the
  base's own names (`merged_state`), so that every backend, push and consumer of full weights works unchanged;
- the adapters alone, named as a PEFT directory names them (`peft_state`), and back (`module_state`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

ADAPTER = "default"  # peft's name for the one adapter a model is given
WRAPPED_PREFIX = "base_model.model."
ADAPTER_SUBDIR = "adapter"  # a LoRA checkpoint's PEFT directory (adapter_config.json, adapter_model.safetensors)


class LoRAMismatchError(ValueError):
    """A checkpoint made with other LoRA settings (or with none) than the trainer loading it."""


def settings(lora: Any) -> dict[str, Any]:
    """What decides an adapter's shape and its effect: a checkpoint is loaded only under the same."""
    return {"rank": lora.rank, "alpha": float(lora.alpha), "target_modules": sorted(lora.target_modules),
            "use_rslora": bool(lora.use_rslora)}


def peft_config(lora: Any, base_model_path: str = ""):
    from peft import LoraConfig

    targets = lora.target_modules
    return LoraConfig(task_type="CAUSAL_LM", r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules="all-linear" if list(targets) == ["all-linear"] else list(targets),
                      init_lora_weights=True if lora.init == "kaiming" else "gaussian", use_rslora=lora.use_rslora,
                      bias="none", base_model_name_or_path=base_model_path or None)


def wrap(model: torch.nn.Module, lora: Any, seed: int, base_model_path: str = "") -> torch.nn.Module:
    """`model` with adapters on its targets, the base frozen. The adapters' initial values come from `seed` alone
    (the global random state is left as it was): every rank, every re-initialisation and every replay from version 0
    starts from the same A (B starts at 0, so version 0 serves exactly the base)."""
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, peft_config(lora, base_model_path))


def scaling(lora: Any) -> float:
    return scaling_of(lora.alpha, lora.rank, lora.use_rslora)


def scaling_of(alpha: float, rank: int, use_rslora: bool) -> float:
    """peft's: alpha / rank, or alpha / sqrt(rank) with rank-stabilised LoRA."""
    return alpha / (math.sqrt(rank) if use_rslora else rank)


def merge_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + s (B A) in W's dtype, as peft's merge computes it (a 16-bit W is added to in float32, then rounded): the
    one formula the trainer's merged policy and a server merging an adapter in place both use, so that the two are
    bitwise equal."""
    return (base + (b @ a) * scale).to(base.dtype)


def merged_state(state: dict[str, torch.Tensor], lora: Any) -> dict[str, torch.Tensor]:
    """The wrapped model's `state` as the base's own state dict, each adapted layer's weight W + s (B A): the weights
    peft's `merge_and_unload` gives, computed as it computes them."""
    s = scaling(lora)
    merged = {}
    for name, tensor in state.items():
        if ".lora_A." in name or ".lora_B." in name:
            continue
        base = name.removeprefix(WRAPPED_PREFIX)
        if base.endswith(".base_layer.weight"):
            layer = name[: -len(".base_layer.weight")]
            a, b = state[f"{layer}.lora_A.{ADAPTER}.weight"], state[f"{layer}.lora_B.{ADAPTER}.weight"]
            tensor = merge_weight(tensor, a, b, s)
        merged[base.replace(".base_layer.", ".")] = tensor
    return merged


def peft_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of the wrapped model's `state`, named as `adapter_model.safetensors` names them."""
    return {name.replace(f".{ADAPTER}.", "."): tensor for name, tensor in state.items()
            if ".lora_A." in name or ".lora_B." in name}


def module_state(saved: dict[str, torch.Tensor], module_names: list[str]) -> dict[str, torch.Tensor]:
    """`saved` (an adapter file's tensors) under the wrapped model's names; a LoRAMismatchError naming what does not
    match where the file's adapters are not exactly the model's."""
    names = {name.replace(f".{ADAPTER}.", "."): name for name in module_names
             if ".lora_A." in name or ".lora_B." in name}
    missing, unknown = sorted(set(names) - set(saved)), sorted(set(saved) - set(names))
    if missing or unknown:
        raise LoRAMismatchError(f"the adapter file does not fit the model's adapters: missing {missing[:3]}"
                                f"{' ...' if len(missing) > 3 else ''}, unknown {unknown[:3]}"
                                f"{' ...' if len(unknown) > 3 else ''}")
    return {names[key]: tensor for key, tensor in saved.items()}


def write_adapter_dir(out_dir: Path, adapters: dict[str, torch.Tensor], lora: Any, base_model_path: str) -> None:
    """A PEFT adapter directory (`PeftModel.from_pretrained`, vLLM's `--lora-modules` and SGLang's `--lora-paths`
    load it as it is): adapter_config.json and adapter_model.safetensors."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    config = peft_config(lora, base_model_path)
    config.save_pretrained(str(out_dir))
    save_file({k: v.contiguous() for k, v in adapters.items()}, str(out_dir / "adapter_model.safetensors"),
              metadata={"format": "pt"})


def read_adapter_dir(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    path = directory / "adapter_model.safetensors"
    if not path.is_file():
        raise LoRAMismatchError(f"no adapter at {path}: the checkpoint is a full fine-tuning one")
    return load_file(str(path))


def check_checkpoint(saved: Any, lora: Any) -> None:
    """LoRAMismatchError unless the checkpoint's recorded LoRA settings (`saved`: trainer_state.json's "lora", None
    for a full fine-tuning checkpoint) are this trainer's (`lora`: trainer.lora)."""
    ours = settings(lora) if lora.enabled else None
    if saved == ours:
        return
    if ours is None:
        raise LoRAMismatchError("the checkpoint holds LoRA adapters (trainer.lora.enabled=true) and this trainer "
                                "trains the full model: resume it with the same trainer.lora settings")
    if saved is None:
        raise LoRAMismatchError("the checkpoint is a full fine-tuning one and this trainer trains LoRA adapters "
                                "(trainer.lora.enabled=true): resume it without trainer.lora")
    differ = [f"trainer.lora.{key}={saved.get(key)!r} (this trainer: {value!r})"
              for key, value in ours.items() if saved.get(key) != value]
    raise LoRAMismatchError(f"the checkpoint's adapters were made with other settings: {', '.join(differ)}")
