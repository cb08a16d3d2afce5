"""Packed micro-batches: sequences laid end to end in rows, cut by a token budget, no padding compute.

A micro-batch is a grid of `rows x width` tokens (width = its longest sequence). With packing, sequences
are placed first-fit-decreasing into rows, several per row; without it each sequence has a row of its own
(the padded baseline). Position ids restart at 0 for every sequence, and the leftover slots of a row form
one more (ignored) segment, so attention is block-diagonal per sequence without an attention mask and a
row never costs more than `width^2` attention, unlike one long 1-D pack.

Shared prefixes: the samples of a GRPO group repeat their prompt, which on short answers is most of every
sequence. Sequences that start alike can form one *unit*: their common prefix (the trunk) laid out once,
then each sequence's remainder (its branch), with an attention mask in which a branch sees the trunk and
itself only, and positions that continue the trunk's. Every token's logits are then those of its own
sequence, so the loss and its gradient are unchanged, for a fraction of the forward tokens.

Per-token values are kept in the packed 1-D order (sequence after sequence) and follow the trajectory
convention: `x[t]` belongs to token `t` of its sequence (e.g. `logprobs[t] = log p(token t | tokens < t)`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from typing import Optional, Sequence

import numpy as np
import torch


@dataclass
class MicroBatch:
    indices: list[int]  # which sequences of the batch, in order
    input_ids: torch.Tensor  # [N] the sequences end to end
    position_ids: torch.Tensor  # [N] restarting at 0 for each sequence
    seq_ids: torch.Tensor  # [N] 0..len(indices)-1: which sequence each token belongs to
    grid_input_ids: torch.Tensor  # [rows, width] what the model runs on
    grid_position_ids: torch.Tensor  # [rows, width]
    grid_index: torch.Tensor  # [N] flat grid slot of each packed token (shared by the tokens of a trunk)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # per-token float values, [N]
    # [rows, 1, width, width], True where a slot may attend; only when some unit shares a trunk
    grid_attention_mask: Optional[torch.Tensor] = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def lengths(self) -> list[int]:
        return torch.bincount(self.seq_ids, minlength=len(self.indices)).tolist()

    @property
    def forward_tokens(self) -> int:
        """Grid slots holding a token: what the model's forward pays for."""
        return int(torch.unique(self.grid_index).numel())


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    # a binary search over slice comparisons (each a C loop) beats a Python loop over the tokens
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def unit_trunk(seqs: Sequence[Sequence[int]]) -> int:
    """The common prefix of sequences laid out as one unit (a lone sequence is all trunk)."""
    return min((common_prefix_length(seqs[0], s) for s in seqs[1:]), default=len(seqs[0]))


def unit_length(seqs: Sequence[Sequence[int]], trunk: Optional[int] = None) -> int:
    """Grid slots of sequences laid out as one unit: their common prefix once, then every remainder."""
    trunk = unit_trunk(seqs) if trunk is None else trunk
    return trunk + sum(len(s) - trunk for s in seqs)


def shared_prefix_units(seqs: Sequence[Sequence[int]], max_width: int) -> list[list[int]]:
    """Groups of `seqs` (positions into it) that share their common prefix; every sequence is in one group.

    Sequences are taken in sorted order, so those that start alike are neighbours, and one joins the group
    before it while the common prefix stays at least as long as every branch (beyond that a unit's row
    attention, quadratic in its width, grows faster than its forward tokens shrink) and the unit fits in
    `max_width` slots. Each group lists its positions in ascending order; groups are ordered by their first.
    """
    units: list[tuple[list[int], int]] = []  # (members, trunk length)
    for i in sorted(range(len(seqs)), key=lambda i: (list(seqs[i]), i)):
        if units:
            members, trunk = units[-1]
            shared = min(trunk, common_prefix_length(seqs[members[0]], seqs[i]))
            branches = [len(seqs[m]) - shared for m in members] + [len(seqs[i]) - shared]
            if shared > 0 and shared >= max(branches) and shared + sum(branches) <= max_width:
                units[-1] = (members + [i], shared)
                continue
        units.append(([i], len(seqs[i])))
    return sorted((sorted(members) for members, _ in units), key=lambda members: members[0])


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
         pack_rows: bool = True, pad_id: int = 0, units: Optional[list[list[int]]] = None) -> MicroBatch:
    """The micro-batch of `batch["input_ids"][i]` for i in `indices`, with the per-token columns `token_keys`.
    `units` (batch indices, together `indices`) lays each group of sequences out around its shared prefix;
    by default every sequence is a unit of its own."""
    if not indices:  # a rank with no data still joins the collectives: one dummy token, weight 0
        seqs, lengths, indices_ = [[pad_id]], [1], [0]
    else:
        seqs = [batch["input_ids"][i] for i in indices]
        lengths = [len(s) for s in seqs]
        indices_ = list(indices)
    where_in = {i: j for j, i in enumerate(indices_)}
    groups = [[where_in[i] for i in unit] for unit in units] if units and indices else [[j] for j in range(len(seqs))]
    if sorted(j for g in groups for j in g) != list(range(len(seqs))):
        raise ValueError("pack: the units must hold every one of the indices exactly once")
    trunks = [unit_trunk([seqs[j] for j in g]) for g in groups]
    unit_lengths = [unit_length([seqs[j] for j in g], t) for g, t in zip(groups, trunks)]
    width = max(unit_lengths)
    where = place_in_rows(unit_lengths, width, pack_rows)
    rows = 1 + max(r for r, _ in where)
    shared = any(len(g) > 1 for g in groups)

    # built in numpy (cheap slice assignment from lists), handed to torch once
    grid_ids = np.full((rows, width), pad_id, dtype=np.int64)
    grid_pos = np.tile(np.arange(width, dtype=np.int64), (rows, 1))
    # per slot: which unit (pad slots: -1) and which branch of it (0: the trunk)
    slot_unit = np.full((rows, width), -1, dtype=np.int64)
    slot_branch = np.zeros((rows, width), dtype=np.int64)
    token_slots: list[range] = [range(0)] * len(seqs)
    branch_slots: list[range] = [range(0)] * len(seqs)
    for u, (g, trunk, n, (row, col)) in enumerate(zip(groups, trunks, unit_lengths, where)):
        base = row * width + col
        grid_ids[row, col: col + trunk] = seqs[g[0]][:trunk]
        slot_unit[row, col: col + n] = u
        grid_pos[row, col: col + n] -= col  # the trunk's positions; branches are renumbered below
        offset = col + trunk
        for b, j in enumerate(g, start=1):
            rest = lengths[j] - trunk
            grid_ids[row, offset: offset + rest] = seqs[j][trunk:]
            grid_pos[row, offset: offset + rest] = np.arange(trunk, lengths[j])
            slot_branch[row, offset: offset + rest] = b
            token_slots[j] = range(base, base + trunk)
            branch_slots[j] = range(row * width + offset, row * width + offset + rest)
            offset += rest
    grid_index = _flat(chain.from_iterable(chain(t, b) for t, b in zip(token_slots, branch_slots)), np.int64)
    grid_ids, grid_pos = torch.from_numpy(grid_ids), torch.from_numpy(grid_pos)
    slot_unit, slot_branch = torch.from_numpy(slot_unit), torch.from_numpy(slot_branch)

    mask = None
    if shared:
        # a slot sees the earlier slots of its unit that are on its trunk or its own branch; a pad slot itself
        unit_q, unit_k = slot_unit[:, :, None], slot_unit[:, None, :]
        branch_q, branch_k = slot_branch[:, :, None], slot_branch[:, None, :]
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        mask = causal & (((unit_q == unit_k) & (unit_q >= 0) & ((branch_k == 0) | (branch_k == branch_q)))
                         | torch.eye(width, dtype=torch.bool))
        mask = mask[:, None]
    else:
        # pad slots count up from 0 after the last sequence of their row: a segment of their own
        used = torch.zeros(rows * width, dtype=torch.bool)
        used[grid_index] = True
        tail_start = used.view(rows, width).long().cumsum(1).max(1, keepdim=True).values
        tail = ~used.view(rows, width)
        grid_pos[tail] = (torch.arange(width).repeat(rows, 1) - tail_start)[tail]

    input_ids = _flat(chain.from_iterable(seqs), np.int64)
    seq_ids = torch.repeat_interleave(torch.arange(len(seqs)), torch.tensor(lengths))
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    position_ids = torch.arange(len(input_ids)) - starts[seq_ids]
    if indices:
        tensors = {k: _flat(chain.from_iterable(batch[k][i] for i in indices), np.float32) for k in token_keys}
    else:
        tensors = {k: torch.zeros(1) for k in token_keys}
    to = lambda t: t.to(device)  # noqa: E731
    return MicroBatch(list(indices), to(input_ids), to(position_ids), to(seq_ids), to(grid_ids), to(grid_pos),
                      to(grid_index), {k: to(v) for k, v in tensors.items()},
                      to(mask) if mask is not None else None)


def _flat(values, dtype) -> torch.Tensor:
    return torch.from_numpy(np.fromiter(values, dtype=dtype))


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
