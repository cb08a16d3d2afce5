"""A run's weights as files other tools load: `areal-pipeline export --format adapter|merged|full` (docs/lora.md).

    adapter: a LoRA checkpoint's PEFT adapter directory (adapter_config.json, adapter_model.safetensors), as it is:
             `PeftModel.from_pretrained(base, dir)`, vLLM's `--lora-modules` and SGLang's `--lora-paths` load it.
    merged:  one Hugging Face model directory (safetensors + the tokenizer). For a LoRA checkpoint peft computes it:
             `PeftModel.from_pretrained(base, adapter).merge_and_unload()`, the base being the adapter's
             `base_model_name_or_path` (the run's model.path) or the one the caller names. For a full fine-tuning
             checkpoint it is the checkpoint's `model/`.
    full:    the checkpoint's `model/` as the trainer saved it (with LoRA: the merged policy the servers served).

The checkpoint is the run's newest saved one, step K, or a directory. The files an export reads are checked against
the checkpoint's checksums.json before anything is written (a corrupt or missing file is named), every other
problem of the request (no checkpoint, an unknown step, an output directory already in use, a base model that is
not there) is a `WeightExportError` raised before the first write, and the output is built under a temporary name
and renamed: an interrupted export never leaves a partial directory under the requested name.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from areal_pipeline.checksums import verify_checksums
from areal_pipeline.run_dir import RunPaths
from areal_pipeline.utils import atomic_directory

WEIGHT_FORMATS = ("adapter", "merged", "full")
# A checkpoint's subdirectories, as training/lora.py and training/checkpoint_io.py name them; spelled here because
# importing those modules imports torch, which copying an adapter does not need.
ADAPTER_SUBDIR = "adapter"
MODEL_SUBDIR = "model"
# `org/name` or `name`: what the Hugging Face hub takes as a model id (a path with more parts is a local one).
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


class WeightExportError(ValueError):
    """A request that cannot be exported as asked; nothing was written."""


@dataclass(frozen=True)
class WeightExport:
    path: Path
    form: str
    checkpoint: Path
    step: Optional[int]
    files: tuple[str, ...]  # relative to `path`
    bytes: int
    base: Optional[str] = None  # the base model a merge loaded

    def describe(self) -> str:
        what = {"adapter": "the LoRA adapter", "merged": "the merged model", "full": "the full model"}[self.form]
        step = f"step {self.step}" if self.step is not None else "the checkpoint"
        onto = f" (onto the base {self.base})" if self.base else ""
        return (f"wrote {what} of {step}{onto} to {self.path}: {len(self.files)} files, {self.bytes} bytes "
                f"({', '.join(self.files)}), from {self.checkpoint}")


def resolve_checkpoint_dir(run_dir: Optional[Path], checkpoint: str = "latest") -> Path:
    """The checkpoint directory `checkpoint` names: "latest" (the run's newest saved step), K (step_K of the run)
    or a checkpoint directory (the run is then not needed)."""
    checkpoint = str(checkpoint)
    if checkpoint != "latest" and not checkpoint.isdigit():
        path = Path(checkpoint)
        if not path.is_dir():
            raise WeightExportError(f"no checkpoint directory {path} (--checkpoint takes latest, a step number or "
                                    f"a checkpoint directory)")
        if not any((path / name).exists() for name in (MODEL_SUBDIR, ADAPTER_SUBDIR, "trainer_state.json")):
            raise WeightExportError(f"{path} is not a checkpoint directory (it has no {MODEL_SUBDIR}/, no "
                                    f"{ADAPTER_SUBDIR}/ and no trainer_state.json)")
        return path
    if run_dir is None:
        raise WeightExportError(f"--checkpoint {checkpoint} needs the run (--run-id)")
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise WeightExportError(f"no run directory {run_dir}")
    paths = RunPaths(run_dir)
    saved = paths.saved_checkpoints()
    if not saved:
        raise WeightExportError(f"run '{run_dir.name}' has no saved checkpoint in {paths.checkpoints}")
    if checkpoint == "latest":
        return paths.checkpoint(saved[-1])
    step = int(checkpoint)
    if step not in saved:
        unfinished = " (its directory is there, but its save did not finish)" if paths.checkpoint(step).is_dir() else ""
        raise WeightExportError(f"run '{run_dir.name}' has no saved checkpoint of step {step}{unfinished}; saved "
                                f"steps: {', '.join(map(str, saved))}")
    return paths.checkpoint(step)


def export_weights(run_dir: Optional[Path], out_dir: Path, form: str, checkpoint: str = "latest",
                   base: Optional[str] = None) -> WeightExport:
    """Write checkpoint `checkpoint` of the run (see `resolve_checkpoint_dir`) to the new directory `out_dir` as
    `form` (adapter | merged | full; the module's doc); `base` replaces the adapter's base model of a merge."""
    if form not in WEIGHT_FORMATS:
        raise WeightExportError(f"unknown weight format {form!r}; valid: {', '.join(WEIGHT_FORMATS)}")
    out_dir = Path(out_dir)
    _check_out_dir(out_dir)
    ckpt = resolve_checkpoint_dir(run_dir, checkpoint)
    lora = _is_lora(ckpt)
    step = _step(ckpt)
    if form == "adapter" and not lora:
        raise WeightExportError(f"{ckpt} is a full fine-tuning checkpoint: it has no LoRA adapter to export "
                                f"(trained without trainer.lora.enabled); export its weights with --format merged "
                                f"or --format full")
    if form == "merged" and lora:
        verify_checksums(ckpt, under=ADAPTER_SUBDIR)
        return _export_merged(ckpt, out_dir, step, _base_model(ckpt / ADAPTER_SUBDIR, base))
    if base is not None:
        raise WeightExportError(f"--base is for merging a LoRA adapter onto its base (--format merged of a LoRA "
                                f"checkpoint); --format {form} of {ckpt} takes none")
    subdir = ADAPTER_SUBDIR if form == "adapter" else MODEL_SUBDIR
    verify_checksums(ckpt, under=subdir)
    with atomic_directory(out_dir) as tmp:
        shutil.copytree(ckpt / subdir, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".*"))
    return _result(out_dir, form, ckpt, step)


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.is_dir() and any(out_dir.iterdir()):
        raise WeightExportError(f"{out_dir} exists and is not empty: name a new (or empty) directory")
    if out_dir.exists() and not out_dir.is_dir():
        raise WeightExportError(f"{out_dir} exists and is not a directory: name a new (or empty) directory")


def _is_lora(ckpt: Path) -> bool:
    """Whether the checkpoint holds LoRA adapters: as its trainer_state.json records (`"lora": null` for full
    fine-tuning), or, for a checkpoint without one, whether it has an adapter directory. A missing adapter of a
    LoRA checkpoint is then named by the checksums, not taken for full fine-tuning."""
    state_path = ckpt / "trainer_state.json"
    if state_path.is_file():
        try:
            return json.loads(state_path.read_text(encoding="utf-8")).get("lora") is not None
        except (ValueError, AttributeError) as e:
            raise WeightExportError(f"{state_path}: unreadable ({e})") from None
    return (ckpt / ADAPTER_SUBDIR).is_dir()


def _step(ckpt: Path) -> Optional[int]:
    name = ckpt.name.removeprefix("step_")
    if ckpt.name.startswith("step_") and name.isdigit():
        return int(name)
    try:
        return int(json.loads((ckpt / "trainer_state.json").read_text(encoding="utf-8"))["version"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _base_model(adapter_dir: Path, base: Optional[str]) -> str:
    """The base model to merge onto: `base`, else the adapter's base_model_name_or_path (the run's model.path, a
    relative path being taken from the current directory as the run took it); checked to be a model directory
    or a hub id before anything loads."""
    if base is None:
        config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
        base = config.get("base_model_name_or_path") or ""
        if not base:
            raise WeightExportError(f"{adapter_dir / 'adapter_config.json'} names no base model: pass --base PATH")
        where = f"the adapter's base model {base!r} (base_model_name_or_path in adapter_config.json)"
    else:
        where = f"the base model {base!r} (--base)"
    path = Path(base)
    if (path / "config.json").is_file():
        return base
    if path.exists() or not _HUB_ID.match(base):
        raise WeightExportError(f"{where} is not a model directory (no {path / 'config.json'}; a relative path is "
                                f"taken from the current directory): pass the base model as --base PATH")
    return base  # a hub id: loading it says whether it exists


def _export_merged(ckpt: Path, out_dir: Path, step: Optional[int], base: str) -> WeightExport:
    from peft import PeftModel
    from transformers import AutoConfig

    from safetensors.torch import load_file

    from areal_pipeline.model import DTYPES, load_model
    from areal_pipeline.training import lora
    from areal_pipeline.training.checkpoint_io import write_hf_dir

    adapter_dir = ckpt / ADAPTER_SUBDIR
    try:
        # the base's own dtype, as a user's `from_pretrained(base, dtype="auto")` would merge it
        dtype = str(getattr(AutoConfig.from_pretrained(base), "dtype", None) or "float32").removeprefix("torch.")
        model = load_model(base, dtype if dtype in DTYPES else "float32")
    except (OSError, ValueError) as e:  # not there, or not a model transformers knows
        raise WeightExportError(f"cannot load the base model {base!r}: {e}; pass it as --base PATH") from None
    try:
        adapted = PeftModel.from_pretrained(model, str(adapter_dir))
        # peft only warns where a base lacks some of the adapter's layers (they would merge as nothing)
        lora.module_state(load_file(str(adapter_dir / "adapter_model.safetensors")), list(adapted.state_dict()))
        merged = adapted.merge_and_unload()
    except (RuntimeError, ValueError, KeyError) as e:  # shapes or module names of another model
        lines = [line.strip() for line in str(e).strip().splitlines()]  # torch lists every mismatched tensor
        raise WeightExportError(f"the adapter {adapter_dir} does not fit the base model {base!r}: "
                                f"{' '.join(lines[:2])}{' ...' if len(lines) > 2 else ''}") from None
    state = {name: tensor.detach() for name, tensor in merged.state_dict().items()}
    with atomic_directory(out_dir) as tmp:
        write_hf_dir(tmp, state, merged.config, base)
    return _result(out_dir, "merged", ckpt, step, base=base)


def _result(out_dir: Path, form: str, ckpt: Path, step: Optional[int], **extra: Any) -> WeightExport:
    files = sorted(p for p in out_dir.rglob("*") if p.is_file())
    return WeightExport(path=out_dir, form=form, checkpoint=ckpt, step=step,
                        files=tuple(p.relative_to(out_dir).as_posix() for p in files),
                        bytes=sum(p.stat().st_size for p in files), **extra)
