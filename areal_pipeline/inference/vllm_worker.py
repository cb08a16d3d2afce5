"""Methods vLLM mixes into its worker (`--worker-extension-cls`), called over HTTP by `POST /collective_rpc`.

This module runs in vLLM's own environment: it imports torch and nothing of the project.

vLLM's `reload_weights` replaces each reloaded module's parameters with new tensors. A model whose output head is
tied to its input embedding (the tiny Qwen2 here, Qwen2.5-0.5B/1.5B) shares one parameter between the two modules:
the head keeps pointing at the old tensor, and on a CPU also keeps the GEMM kernel prepacked from it, so the
server samples with the new body and the old head, silently. `retie_embeddings` points the head at the embedding
again and has its kernel prepared anew; `reload_weights_tied` does both in one call.
"""

from __future__ import annotations

from typing import Any


def _as_bool(value: Any) -> bool:
    # /collective_rpc passes kwargs as JSON, strings by convention
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


class WeightSyncExtension:
    """Mixed into vLLM's worker: `self.model_runner` and `self.vllm_config` are the worker's."""

    def _areal_model(self):
        return self.model_runner.get_model()

    def _areal_tied_pair(self):
        """(lm_head, embed_tokens) of a model whose config ties them, else None."""
        hf_config = self.vllm_config.model_config.hf_config
        text_config = getattr(hf_config, "get_text_config", lambda: hf_config)()
        if not getattr(text_config, "tie_word_embeddings", False):
            return None
        model = self._areal_model()
        head = getattr(model, "lm_head", None)
        body = getattr(model, "model", None)
        embed = getattr(body, "embed_tokens", None) if body is not None else None
        if head is None or embed is None or not hasattr(head, "weight") or not hasattr(embed, "weight"):
            raise RuntimeError(f"{type(model).__name__} ties its embeddings but has no lm_head / model.embed_tokens "
                               "to tie again after a reload")
        return head, embed

    @staticmethod
    def _areal_apart(head, embed) -> bool:
        """Whether the head computes with something other than the embedding: another tensor, or a kernel prepared
        from an old one (the head's own GEMM on a few fixed inputs against the embedding's matrix)."""
        import torch

        weight = embed.weight
        if head.weight is not weight:
            return True
        method = getattr(head, "quant_method", None)
        if method is None or not hasattr(method, "apply"):
            return False
        generator = torch.Generator(device=weight.device).manual_seed(0)
        x = torch.randn(4, weight.shape[1], generator=generator, device=weight.device).to(weight.dtype)
        with torch.no_grad():
            served = method.apply(head, x).float()
            wanted = torch.nn.functional.linear(x, weight).float()
        return not torch.allclose(served, wanted, rtol=2e-2, atol=2e-2 * float(wanted.abs().max()))

    def tied_head_state(self) -> dict:
        """Whether the model ties its head to its embedding, and whether the two are now apart (a reload broke the
        tie): for naming the parameters when a weight check fails."""
        pair = self._areal_tied_pair()
        return {"tied": pair is not None, "apart": pair is not None and self._areal_apart(*pair)}

    def retie_embeddings(self) -> dict:
        """Point a tied output head at the current input embedding again. Returns whether the model is tied and
        whether the head had come apart from the embedding."""
        pair = self._areal_tied_pair()
        if pair is None:
            return {"tied": False, "was_apart": False}
        head, embed = pair
        was_apart = self._areal_apart(head, embed)
        head.weight = embed.weight
        method = getattr(head, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            # the CPU path keeps a kernel prepacked from the weight it saw at load: build it from the new one
            method.process_weights_after_loading(head)
        return {"tied": True, "was_apart": was_apart}

    def reload_weights_tied(self, weights_path: str, retie: Any = True) -> dict:
        """vLLM's `reload_weights(weights_path=...)`, then (`retie`) `retie_embeddings`."""
        self.reload_weights(weights_path=str(weights_path))
        return self.retie_embeddings() if _as_bool(retie) else {"tied": None, "was_apart": None}
