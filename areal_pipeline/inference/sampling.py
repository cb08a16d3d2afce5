"""Sampling: the next token of every row of a decode step, under each row's `SamplingParams` (types.py).

The logprob returned with a token is that of the full distribution at the request's temperature
(`log_softmax(logits / T)`), taken before top-k / top-p / min-p filtering: what a trainer's teacher-forced
forward pass at the same temperature computes (the trainer's contract).
"""

from __future__ import annotations

from typing import Optional

import torch

from areal_pipeline.inference.types import SamplingParams


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
