"""Packed 1-D micro-batches: sequences laid end to end, cut by a token budget, no padding compute.

Per-token arrays follow the trajectory convention: `x[t]` belongs to token `t` of its sequence
(e.g. `logprobs[t] = log p(token t | tokens < t)`, 0 for a sequence's first token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass
class MicroBatch:
    indices: list[int]  # which sequences of the batch, in order
    input_ids: torch.Tensor  # [N] the sequences end to end
    position_ids: torch.Tensor  # [N] restarting at 0 for each sequence (marks the boundaries)
    seq_ids: torch.Tensor  # [N] 0..len(indices)-1: which packed sequence each token belongs to
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # per-token float values, [N]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def lengths(self) -> list[int]:
        return torch.bincount(self.seq_ids, minlength=len(self.indices)).tolist()


def pack(batch: dict[str, Sequence], indices: list[int], token_keys: Sequence[str], device="cpu") -> MicroBatch:
    """Pack `batch["input_ids"][i]` for i in `indices`, with the per-token columns `token_keys`."""
    seqs = [batch["input_ids"][i] for i in indices]
    lengths = [len(s) for s in seqs]
    if not indices:  # a rank with no data still joins the collectives: one dummy token, weight 0
        dummy = {k: torch.zeros(1, device=device) for k in token_keys}
        z = torch.zeros(1, dtype=torch.long, device=device)
        return MicroBatch([], z, z, z, dummy)
    input_ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=device)
    position_ids = torch.cat([torch.arange(n, device=device) for n in lengths])
    seq_ids = torch.repeat_interleave(torch.arange(len(seqs), device=device), torch.tensor(lengths, device=device))
    tensors = {k: torch.tensor([v for i in indices for v in batch[k][i]], dtype=torch.float32, device=device)
               for k in token_keys}
    return MicroBatch(list(indices), input_ids, position_ids, seq_ids, tensors)


def unpack(values: torch.Tensor, mb: MicroBatch) -> list[list[float]]:
    """Split a per-token [N] tensor of a micro-batch back into per-sequence lists."""
    return [chunk.tolist() for chunk in torch.split(values.detach().cpu(), mb.lengths)] if mb.indices else []


def balance(lengths: dict[int, int], n_bins: int) -> list[list[int]]:
    """Split sequence indices into `n_bins` bins of near-equal token counts (longest first into the
    lightest bin); each bin keeps the indices in ascending order so the result is deterministic."""
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    load = [0] * n_bins
    for i in sorted(lengths, key=lambda i: (-lengths[i], i)):
        b = min(range(n_bins), key=lambda b: (load[b], b))
        bins[b].append(i)
        load[b] += lengths[i]
    return [sorted(b) for b in bins]


def count_micro_batches(lengths: list[int], max_tokens: int) -> int:
    """How many micro-batches of at most `max_tokens` a first-fit-decreasing packing needs."""
    loads: list[int] = []
    for n in sorted(lengths, reverse=True):
        for b, load in enumerate(loads):
            if load + n <= max_tokens:
                loads[b] += n
                break
        else:
            loads.append(n)
    return len(loads)
