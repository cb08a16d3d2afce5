"""Check that inference servers serve the trainer's weights, after every weight update and on every backend.

    probe = probe_ids(tokenizer)
    expected = trainer.call("probe_logp", input_ids=probe)["logprobs"]
    report = await verify_served(engine, probe, expected, version, tolerance)   # WeightMismatchError if not

The check runs the model rather than reading parameters: each server's logprobs of a short fixed probe, against the
trainer's of the same ids. A parameter the server loaded but does not use (vLLM's output head left on the old
tensor of a tied embedding after `reload_weights`) reads right and computes wrong; the probe sees what sampling
sees. One request per server, one forward pass in the trainer.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

# Text every tokenizer encodes: digits, words and punctuation, as the episodes hold
PROBE_TEXT = "Question: what is 17 + 25? Answer: 42. The capital of France is Paris; 3 * 4 = 12."
PROBE_MAX_TOKENS = 32

# Largest mean |server - trainer| probe logprob that passes, by precision. Both in float32 the two differ by the
# order of their reductions alone; a 16-bit side rounds every weight and activation, so the bound is far looser. The
# mean, not the largest: in 16 bits a single unlikely token may be off by more than the rest together.
TOLERANCE_FP32 = 1e-3
TOLERANCE_16BIT = 0.1


class WeightMismatchError(RuntimeError):
    """A server does not serve the weights the trainer pushed."""

    def __init__(self, backend: str, address: str, version: int, mean_diff: float, max_diff: float,
                 tolerance: float, detail: str = ""):
        super().__init__(
            f"weight update to version {version} not served: {backend} server {address} gives the probe's tokens "
            f"logprobs {mean_diff:.4g} away from the trainer's on average (up to {max_diff:.4g}; tolerance "
            f"{tolerance:.3g}), so its parameters are not the trainer's{': ' + detail if detail else ''}. Not running "
            "on stale weights.")
        self.backend, self.address, self.version = backend, address, version
        self.mean_diff, self.max_diff, self.tolerance = mean_diff, max_diff, tolerance


def probe_ids(tokenizer) -> list[int]:
    ids = list(tokenizer(PROBE_TEXT, add_special_tokens=False)["input_ids"])[:PROBE_MAX_TOKENS]
    if len(ids) < 2:
        raise ValueError(f"the tokenizer encodes the weight probe in {len(ids)} token(s); it needs 2 or more")
    return ids


def served_dtype(inference_cfg: Any) -> str:
    """The dtype the servers compute in, as configured ("auto" where the config leaves it to the server)."""
    inf = inference_cfg
    return {"cpu": inf.dtype, "sglang": inf.sglang.dtype, "vllm": inf.vllm.dtype}.get(inf.backend, "auto")


def tolerance(inference_cfg: Any, trainer_fp32: bool) -> float:
    """`inference.verify_tolerance`, else by precision: float32 only where both sides are sure to be."""
    if inference_cfg.verify_tolerance > 0:
        return float(inference_cfg.verify_tolerance)
    return TOLERANCE_FP32 if trainer_fp32 and served_dtype(inference_cfg) == "float32" else TOLERANCE_16BIT


async def _diagnosis(engine, address: str) -> str:
    """Where the backend can say which parameters are off, what it says (vLLM: a tied head apart from its
    embedding); "" where it cannot."""
    adapter = getattr(engine, "adapter", None)  # the policy as a LoRA adapter over the served base (trainer.lora.push)
    name = adapter if isinstance(adapter, str) or adapter is None else adapter.name
    if name:
        return f"the LoRA adapter the server serves as '{name}' is not the trainer's (the adapter pushed did not reach it)"
    if getattr(engine, "backend", "") != "vllm":
        return ""
    try:
        reply = await engine.request(address, "/collective_rpc", {"method": "tied_head_state"}, retries=0)
        state = reply["results"][0]
    except Exception:  # the diagnosis only adds to the error being raised
        return ""
    if state.get("tied") and state.get("apart"):
        return ("lm_head.weight is no longer model.embed_tokens.weight on the server although the model ties them "
                "(vLLM's reload_weights leaves a tied head on the old tensor; the client re-ties it after each reload)")
    return ""


async def verify_served(engine, probe: list[int], expected: list[float], version: int, tol: float,
                        addresses: Optional[list[str]] = None, backend: Optional[str] = None) -> dict[str, float]:
    """Each server's mean probe logprob difference from `expected` (address -> value); WeightMismatchError
    naming the first server beyond `tol` and its `backend` (inference.backend; default: the engine's protocol)."""
    addresses = list(addresses or engine.addresses)
    backend = backend or engine.backend
    served = await asyncio.gather(*(engine.probe_logprobs(a, probe) for a in addresses))
    report = {}
    for address, values in zip(addresses, served):
        if len(values) != len(expected):
            raise WeightMismatchError(backend, address, version, float("inf"), float("inf"), tol,
                                      f"{len(values)} probe logprobs, the trainer {len(expected)}")
        diffs = [abs(a - b) for a, b in zip(values, expected)]
        mean = sum(diffs) / len(diffs)
        if not mean <= tol:  # NaN fails too
            raise WeightMismatchError(backend, address, version, mean, max(diffs), tol,
                                      await _diagnosis(engine, address))
        report[address] = mean
    return report
