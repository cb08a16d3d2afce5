"""Micro-batch layouts: shared-prefix units, their grid, positions and attention mask, by hand."""

from __future__ import annotations

import pytest
import torch

from areal_pipeline.training.losses import gather_logprobs
from areal_pipeline.training.packing import pack, shared_prefix_units, unit_length


def test_units_join_sequences_whose_common_prefix_is_at_least_every_branch():
    seqs = [
        [1, 2, 3, 4, 9],     # 0: prompt 1 2 3 4, answer 9
        [7, 7, 7],           # 1: alone
        [1, 2, 3, 4, 8, 8],  # 2: same prompt, answer 8 8
        [1, 2, 3, 4, 9],     # 3: a duplicate of 0
        [1, 2, 5, 5, 5, 5],  # 4: shares only 1 2 with them: branches of 4 would outgrow a trunk of 2
    ]
    assert shared_prefix_units(seqs, max_width=100) == [[0, 2, 3], [1], [4]]
    assert unit_length([seqs[0], seqs[2], seqs[3]]) == 4 + 1 + 2 + 1
    assert unit_length([seqs[1]]) == 3
    # the width budget closes a unit: 4 + 1 + 2 = 7 slots fit, the duplicate's 8th does not
    assert shared_prefix_units(seqs, max_width=7) == [[0, 2], [1], [3], [4]]


def test_shared_prefix_layout_positions_and_mask():
    batch = {"input_ids": [[1, 2, 3, 9], [5, 6], [1, 2, 3, 8, 8]], "loss_mask": [[0, 0, 0, 1], [0, 1], [0, 0, 0, 1, 1]]}
    mb = pack(batch, [0, 1, 2], ("loss_mask",), pack_rows=False, units=[[0, 2], [1]])
    # row 0: trunk 1 2 3, branch of sequence 0 (9), branch of sequence 2 (8 8); row 1: sequence 1 and padding
    assert mb.grid_input_ids.tolist() == [[1, 2, 3, 9, 8, 8], [5, 6, 0, 0, 0, 0]]
    assert mb.grid_position_ids[0].tolist() == [0, 1, 2, 3, 3, 4]
    assert mb.grid_position_ids[1, :2].tolist() == [0, 1]
    # tokens in the packed order (sequence after sequence) and the slots they read
    assert mb.input_ids.tolist() == [1, 2, 3, 9, 5, 6, 1, 2, 3, 8, 8]
    assert mb.grid_index.tolist() == [0, 1, 2, 3, 6, 7, 0, 1, 2, 4, 5]
    assert mb.forward_tokens == 8 and mb.num_tokens == 11
    allowed = mb.grid_attention_mask[:, 0].int().tolist()
    assert allowed[0] == [[1, 0, 0, 0, 0, 0],
                          [1, 1, 0, 0, 0, 0],
                          [1, 1, 1, 0, 0, 0],
                          [1, 1, 1, 1, 0, 0],   # 9 sees the trunk and itself
                          [1, 1, 1, 0, 1, 0],   # the first 8 sees the trunk, not 9
                          [1, 1, 1, 0, 1, 1]]
    assert allowed[1] == [[1, 0, 0, 0, 0, 0],
                          [1, 1, 0, 0, 0, 0],
                          [0, 0, 1, 0, 0, 0],   # padding sees only itself
                          [0, 0, 0, 1, 0, 0],
                          [0, 0, 0, 0, 1, 0],
                          [0, 0, 0, 0, 0, 1]]
    assert mb.tensors["loss_mask"].tolist() == [0, 0, 0, 1, 0, 1, 0, 0, 0, 1, 1]

    # packed into rows, the second unit goes into its own row after the first (width 6 is full)
    packed = pack(batch, [0, 1, 2], (), pack_rows=True, units=[[0, 2], [1]])
    assert packed.grid_input_ids.shape == (2, 6) and packed.grid_index.tolist() == mb.grid_index.tolist()


def test_without_shared_units_the_layout_is_the_plain_packing():
    batch = {"input_ids": [[1, 2, 3], [4, 5]]}
    mb = pack(batch, [0, 1], (), pack_rows=True)
    assert mb.grid_attention_mask is None
    assert mb.grid_input_ids.tolist() == [[1, 2, 3], [4, 5, 0]]
    assert mb.grid_position_ids.tolist() == [[0, 1, 2], [0, 1, 0]]  # the pad slot starts a segment of its own
    assert mb.grid_index.tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="exactly once"):
        pack(batch, [0, 1], (), units=[[0]])


def test_gather_logprobs_from_shared_rows():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 0.0, 0.0]])
    rows, labels = torch.tensor([0, 0, 1]), torch.tensor([2, 1, 0])
    expected = torch.log_softmax(logits / 2, dim=-1)[rows, labels]
    assert torch.allclose(gather_logprobs(logits, labels, temperature=2.0, rows=rows), expected)
    assert torch.allclose(gather_logprobs(logits[rows], labels, temperature=2.0), expected)
