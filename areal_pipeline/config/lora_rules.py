"""The configuration's rules of a LoRA run's pushes (config/rules.py holds the cross rule in CROSS_RULES): whether the
adapter travels alone to the servers, and why it cannot."""

from __future__ import annotations

from typing import Iterator, Optional

from areal_pipeline.config.host_rules import Key
from areal_pipeline.config.schema import ExperimentConfig


def adapter_push(cfg: ExperimentConfig) -> bool:
    """Whether a push sends the LoRA adapter alone (trainer.lora.push; "auto": where it can go alone, to the servers
    the run launches, from disk: vLLM loads it with its runtime LoRA, SGLang and the project's server through
    SGLang's /load_lora_adapter)."""
    lora = cfg.trainer.lora
    return lora.enabled and (lora.push == "adapter" or (lora.push == "auto" and adapter_push_problem(cfg) is None
                                                        and not cfg.inference.addresses))


def adapter_push_problem(cfg: ExperimentConfig) -> Optional[str]:
    """Why the adapter cannot travel alone to this run's servers (None: it can)."""
    inf = cfg.inference
    if cfg.trainer.weight_sync != "disk":
        return f"needs trainer.weight_sync=disk (got {cfg.trainer.weight_sync!r}): an adapter is a few MB, read from disk"
    if inf.backend == "sglang" and inf.sglang.dp_size > 1:
        return (f"SGLang loads adapters at run time only with one data-parallel replica (inference.sglang.dp_size="
                f"{inf.sglang.dp_size})")
    return None


def adapter_push_is_possible(cfg: ExperimentConfig, key: Key) -> Iterator[str]:
    lora = cfg.trainer.lora
    if lora.enabled and lora.push == "adapter" and (problem := adapter_push_problem(cfg)) is not None:
        yield f"{key('trainer.lora.push')}='adapter': {problem}; 'merged' works with every backend"
