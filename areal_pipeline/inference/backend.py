"""The inference client for a run's backend: above both clients, so neither imports the other's module back."""

from __future__ import annotations

from typing import Any, Optional

from areal_pipeline.config import InferenceConfig
from areal_pipeline.inference.adapters import ServedAdapter
from areal_pipeline.inference.client import RemoteSGLangEngine
from areal_pipeline.inference.vllm_client import RemoteVLLMEngine


def engine_for(addresses: list[str], cfg: InferenceConfig, adapter: Optional[ServedAdapter] = None,
               **kwargs: Any) -> RemoteSGLangEngine:
    """The client that speaks `cfg.backend`'s protocol: vLLM's, else SGLang's (SGLang and the project's server).
    `adapter`: where pushes send the LoRA adapter alone, the run's (vLLM serves every version under its prefix)."""
    options = {"request_timeout": cfg.request_timeout, "request_retries": cfg.request_retries,
               "setup_timeout": cfg.setup_timeout, "pause_timeout": cfg.pause_timeout, "kind": cfg.backend, **kwargs}
    if cfg.backend == "vllm":
        return RemoteVLLMEngine(addresses, seeded=cfg.vllm.seeded_sampling,
                                adapter=adapter.prefix if adapter is not None else None, **options)
    return RemoteSGLangEngine(addresses, adapter=adapter, **options)
