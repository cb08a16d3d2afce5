"""Sampling: what a request's `sampling_params` hold, and the next token of every row of a decode step.

The logprob returned with a token is that of the full distribution at the request's temperature
(`log_softmax(logits / T)`), taken before top-k / top-p / min-p filtering: what a trainer's teacher-forced
forward pass at the same temperature computes (the trainer's contract).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from areal_pipeline.http_json import RequestRejected, check_bool, check_int, check_number, shown

GREEDY_TEMPERATURE = 1e-6
RequestError = RequestRejected  # a request the server rejects with HTTP 400 (and a message)


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    sampling_seed: Optional[int] = None

    # Accepted for compatibility only at their neutral value: RL rollouts never change them, and
    # silently ignoring another value would make logprobs disagree with the trainer.
    _NEUTRAL = {"n": 1, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
                "min_new_tokens": 0}

    @classmethod
    def from_json(cls, data: Any) -> "SamplingParams":
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise RequestError(f"sampling_params must be a JSON object, got {shown(data)}")
        names = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in names:
                raise RequestError(f"unknown field '{key}' in sampling_params; valid: {', '.join(sorted(names))}")
        data = {k: v for k, v in data.items() if v is not None or k == "sampling_seed"}
        if isinstance(data.get("stop"), str):
            data["stop"] = [data["stop"]]
        params = cls(**data)
        params.validate()
        return params

    def validate(self) -> None:
        check_int("max_new_tokens", self.max_new_tokens, minimum=0)
        if check_number("temperature", self.temperature) < 0:
            raise RequestError(f"'temperature' must be non-negative, got {shown(self.temperature)}")
        if not 0 < check_number("top_p", self.top_p) <= 1:
            raise RequestError(f"'top_p' must be in (0, 1], got {shown(self.top_p)}")
        if type(self.top_k) is not int or self.top_k == 0 or self.top_k < -1:
            raise RequestError(f"'top_k' must be -1 (whole vocabulary) or at least 1, got {shown(self.top_k)}")
        if not 0 <= check_number("min_p", self.min_p) <= 1:
            raise RequestError(f"'min_p' must be in [0, 1], got {shown(self.min_p)}")
        if not (isinstance(self.stop, list) and all(type(s) is str and s for s in self.stop)):
            raise RequestError(f"'stop' must be a non-empty string or a list of them, got {shown(self.stop)}")
        if not (isinstance(self.stop_token_ids, list) and all(type(t) is int for t in self.stop_token_ids)):
            raise RequestError(f"'stop_token_ids' must be a list of integers, got {shown(self.stop_token_ids)}")
        check_bool("ignore_eos", self.ignore_eos)
        check_bool("skip_special_tokens", self.skip_special_tokens)
        if self.sampling_seed is not None:  # the range torch.Generator.manual_seed takes
            check_int("sampling_seed", self.sampling_seed, minimum=-(1 << 63), maximum=(1 << 64) - 1)
        for name, neutral in self._NEUTRAL.items():
            value = getattr(self, name)
            if type(value) not in (int, float) or value != neutral:
                raise RequestError(f"{name}={shown(value)} is not supported by the CPU server (only {neutral!r})")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


def sample_next_tokens(logits: torch.Tensor, params: list[SamplingParams],
                       generators: list[Optional[torch.Generator]],
                       default_generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of `logits` [rows, vocab] under the row's `params`, drawn with the row's own generator
    (a request's `sampling_seed`) or `default_generator`; returned with its logprob at the row's temperature."""
    device = logits.device
    temps = torch.tensor([1.0 if p.greedy else float(p.temperature) for p in params], device=device)
    logprobs = torch.log_softmax(logits / temps[:, None], dim=-1)
    probs = filter_probs(params, logprobs.exp())
    cdf = probs.cumsum(-1)
    u = torch.rand(len(params), generator=default_generator, device=device)
    for i, generator in enumerate(generators):
        if generator is not None:
            u[i] = torch.rand(1, generator=generator, device=device)[0]
    u = u * cdf[:, -1]
    tokens = torch.searchsorted(cdf, u[:, None]).squeeze(-1).clamp_(max=logits.shape[-1] - 1)
    greedy = torch.tensor([p.greedy for p in params], device=device)
    if greedy.any():
        tokens = torch.where(greedy, logits.argmax(-1), tokens)
    return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)


def filter_probs(params: list[SamplingParams], probs: torch.Tensor) -> torch.Tensor:
    """`probs` [rows, vocab] with what each row's top-k, top-p and min-p leave out set to 0 (not renormalised:
    sampling scales by the row's remaining mass)."""
    if not any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params):
        return probs
    device, vocab = probs.device, probs.shape[-1]
    top_k = torch.tensor([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([float(p.top_p) for p in params], device=device)
    min_p = torch.tensor([float(p.min_p) for p in params], device=device)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=device)[None, :]
    cumulative = sorted_probs.cumsum(-1)
    # keep a token while the mass before it is below top_p (so the first token always stays)
    keep = (rank < top_k[:, None]) & (cumulative - sorted_probs < top_p[:, None])
    keep &= sorted_probs >= min_p[:, None] * sorted_probs[:, :1]
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs * keep)
