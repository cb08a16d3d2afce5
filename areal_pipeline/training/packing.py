"""Packed micro-batches: sequences laid end to end in rows, cut by a token budget, no padding compute.

A micro-batch is a grid of `rows x width` tokens (width = its longest sequence). With packing, sequences
are placed first-fit-decreasing into rows, several per row; without it each sequence has a row of its own
(the padded baseline). Position ids restart at 0 for every sequence, and the leftover slots of a row form
one more (ignored) segment, so attention is block-diagonal per sequence without an attention mask and a
row never costs more than `width^2` attention, unlike one long 1-D pack.

Per-token values are kept in the packed 1-D order (sequence after sequence) and follow the trajectory
convention: `x[t]` belongs to token `t` of its sequence (e.g. `logprobs[t] = log p(token t | tokens < t)`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch


@dataclass
class MicroBatch:
    indices: list[int]  # which sequences of the batch, in order
    input_ids: torch.Tensor  # [N] the sequences end to end
    position_ids: torch.Tensor  # [N] restarting at 0 for each sequence
    seq_ids: torch.Tensor  # [N] 0..len(indices)-1: which sequence each token belongs to
    grid_input_ids: torch.Tensor  # [rows, width] what the model runs on
    grid_position_ids: torch.Tensor  # [rows, width]
    grid_index: torch.Tensor  # [N] flat grid slot of each packed token
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # per-token float values, [N]

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def lengths(self) -> list[int]:
        return torch.bincount(self.seq_ids, minlength=len(self.indices)).tolist()


def place_in_rows(lengths: list[int], width: int, pack: bool) -> list[tuple[int, int]]:
    """(row, column offset) of each sequence: first-fit decreasing when packing, else one row each."""
    if not pack:
        return [(i, 0) for i in range(len(lengths))]
    fill: list[int] = []
    where = [(0, 0)] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for row, used in enumerate(fill):
            if used + lengths[i] <= width:
                where[i] = (row, used)
                fill[row] += lengths[i]
                break
        else:
            where[i] = (len(fill), 0)
            fill.append(lengths[i])
    return where


def pack(batch: dict[str, Sequence], indices: list[int], token_keys: Sequence[str], device="cpu",
         pack_rows: bool = True, pad_id: int = 0) -> MicroBatch:
    """The micro-batch of `batch["input_ids"][i]` for i in `indices`, with the per-token columns `token_keys`."""
    if not indices:  # a rank with no data still joins the collectives: one dummy token, weight 0
        seqs, lengths = [[pad_id]], [1]
    else:
        seqs = [batch["input_ids"][i] for i in indices]
        lengths = [len(s) for s in seqs]
    width = max(lengths)
    where = place_in_rows(lengths, width, pack_rows)
    rows = 1 + max(r for r, _ in where)
    grid_ids = torch.full((rows, width), pad_id, dtype=torch.long)
    # pad slots count up from 0 after the last sequence of their row: a segment of their own
    grid_pos = torch.arange(width).repeat(rows, 1)
    grid_index = []
    for seq, n, (row, col) in zip(seqs, lengths, where):
        grid_ids[row, col: col + n] = torch.tensor(seq)
        grid_pos[row, col: col + n] = torch.arange(n)
        grid_index.extend(range(row * width + col, row * width + col + n))
    used = torch.zeros(rows * width, dtype=torch.bool)
    used[grid_index] = True
    tail_start = used.view(rows, width).long().cumsum(1).max(1, keepdim=True).values
    tail = ~used.view(rows, width)
    grid_pos[tail] = (torch.arange(width).repeat(rows, 1) - tail_start)[tail]

    input_ids = torch.tensor([t for s in seqs for t in s], dtype=torch.long)
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    seq_ids = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(lengths))
    if indices:
        tensors = {k: torch.tensor([v for i in indices for v in batch[k][i]], dtype=torch.float32) for k in token_keys}
    else:
        tensors = {k: torch.zeros(1) for k in token_keys}
    to = lambda t: t.to(device)  # noqa: E731
    return MicroBatch(list(indices), to(input_ids), to(position_ids), to(seq_ids), to(grid_ids), to(grid_pos),
                      to(torch.tensor(grid_index, dtype=torch.long)), {k: to(v) for k, v in tensors.items()})


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
