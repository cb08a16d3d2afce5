"""A trainer checkpoint's files, and nothing pickled: the model as a Hugging Face directory (config.json +
model.safetensors + the tokenizer's files), the optimizer state as safetensors plus JSON param groups, and the
RNG states as JSON."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch

MODEL_SUBDIR = "model"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "generation_config.json")


def write_hf_dir(out_dir: Path, state: dict[str, torch.Tensor], config, source_dir: str) -> None:
    """config.json + model.safetensors (+ the tokenizer files of `source_dir`): loadable by `from_pretrained`
    and servable by SGLang."""
    import shutil

    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    if getattr(config, "tie_word_embeddings", False):
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    save_file({k: v.contiguous() for k, v in state.items()}, str(out_dir / "model.safetensors"),
              metadata={"format": "pt"})
    config.save_pretrained(out_dir)
    source = Path(source_dir)
    if source.is_dir():
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, out_dir / name)
    else:  # a hub id: let transformers fetch and write the tokenizer
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(source_dir).save_pretrained(out_dir)


def read_hf_weights(model_dir: Path, model) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(str(f)))
    if getattr(model.config, "tie_word_embeddings", False) and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def flatten_optimizer_state(optim_state: dict) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Optimizer state as safetensors-ready tensors plus JSON param groups (no pickle anywhere)."""
    tensors = {}
    for fqn, slots in optim_state.get("state", {}).items():
        for slot, value in slots.items():
            tensors[f"{fqn}::{slot}"] = torch.as_tensor(value).detach().cpu().contiguous()
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
              for g in optim_state.get("param_groups", [])]
    return tensors, groups


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], groups: list[dict]) -> dict:
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        fqn, slot = key.rsplit("::", 1)
        state.setdefault(fqn, {})[slot] = value
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in groups]
    return {"state": state, "param_groups": groups}


def rng_state() -> dict[str, Any]:
    state = {"python": _jsonable(random.getstate()), "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(_tupled(state["python"]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))


def _jsonable(x):
    return [_jsonable(v) for v in x] if isinstance(x, (tuple, list)) else x


def _tupled(x):
    return tuple(_tupled(v) for v in x) if isinstance(x, list) else x
