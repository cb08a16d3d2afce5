"""Batch shards, the `advantages` node's output and the trainer's input: one iteration's rollout shards as tensors,
through `ppo.advantage` (advantage_registry.py), back to Parquet; and what the trainer reads of them.

Batch shards are the rollout's trajectory columns plus per-token `advantages`, `returns`, `token_rewards`,
`kl` and, when the trainer recomputed them, `prox_logprobs` / `ref_logprobs`; and per-trajectory
`task_reward` (the transformed, normalised reward; the raw one where the advantage took returns instead).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

from areal_pipeline.data.shards import read_table, write_table
from areal_pipeline.training.advantage_registry import make_advantage
from areal_pipeline.training.advantages import advantage_stats

TOKEN_COLUMNS_OUT = ("advantages", "returns", "token_rewards", "kl")


def pad(rows: list[list[float]], width: int) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row, dtype=torch.float32)
    return out


class _RaggedLayout:
    """Where a list column's values sit in a [rows, width] grid (row i's values in its first len(i) slots):
    per-token columns move between Parquet and tensors without a python loop over rows."""

    def __init__(self, lengths: np.ndarray):
        self.lengths = lengths
        self.offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        self.rows = np.repeat(np.arange(len(lengths)), lengths)
        self.cols = np.arange(int(self.offsets[-1])) - np.repeat(self.offsets[:-1], lengths)
        self.width = int(lengths.max(initial=1))

    def pad(self, column) -> torch.Tensor:
        """A list<number> column (with these lengths) as a zero-padded float32 [rows, width] tensor."""
        column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
        if not np.array_equal(lengths, self.lengths):
            raise ValueError("a per-token column's lengths differ from input_ids'")
        out = np.zeros((len(self.lengths), self.width), dtype=np.float32)
        out[self.rows, self.cols] = column.flatten().to_numpy(zero_copy_only=False)
        return torch.from_numpy(out)

    def pad_exact(self, column) -> torch.Tensor:
        """`pad` in the column's own dtype (int64 state keys stay exact)."""
        column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        if not np.array_equal(pc.list_value_length(column).to_numpy(zero_copy_only=False), self.lengths):
            raise ValueError("a per-token column's lengths differ from input_ids'")
        values = column.flatten().to_numpy(zero_copy_only=False)
        out = np.zeros((len(self.lengths), self.width), dtype=values.dtype)
        out[self.rows, self.cols] = values
        return torch.from_numpy(out)

    def unpad(self, grid: torch.Tensor) -> pa.ListArray:
        values = pa.array(grid.detach().to(torch.float32).numpy()[self.rows, self.cols], type=pa.float32())
        return pa.ListArray.from_arrays(pa.array(self.offsets, type=pa.int32()), values)


def compute_batch(rollout: pa.Table, ppo_cfg, extra_token_columns: Optional[dict[str, list[list[float]]]] = None,
                  eos_stop_reason: str = "stop") -> tuple[pa.Table, dict[str, float]]:
    """Advantages for one iteration's rollout table, by `ppo_cfg.advantage`; returns the batch table and its stats.

    The advantage gets the rollout as tensors: besides rewards, masks, logprobs and groups, a workflow's per-turn
    `token_returns` and the rollout's `baseline_rewards`, each where every trajectory has one.
    """
    extra = extra_token_columns or {}
    layout = _RaggedLayout(pc.list_value_length(rollout.column("input_ids")).to_numpy(zero_copy_only=False))
    width = layout.width
    group_ids = pc.dictionary_encode(rollout.column("group_id").combine_chunks()).indices  # in order of appearance
    batch = {
        "rewards": torch.from_numpy(rollout.column("reward").to_numpy().astype(np.float32)),
        "loss_mask": layout.pad(rollout.column("loss_mask")),
        "logprobs": layout.pad(rollout.column("logprobs")),
        "group_ids": torch.from_numpy(group_ids.to_numpy(zero_copy_only=False).astype(np.int64)),
        "no_eos": torch.from_numpy(pc.not_equal(rollout.column("stop_reason"), eos_stop_reason)
                                   .to_numpy(zero_copy_only=False).astype(bool)),
    }
    if "ref_logprobs" in extra:
        batch["ref_logprobs"] = pad(extra["ref_logprobs"], width)
    token_returns = _given_by_every_row(rollout, "token_returns")
    if token_returns is not None:
        batch["token_returns"] = pad(token_returns, width)
    for name in ("step_states", "step_rewards"):
        if _given_by_every_row(rollout, name) is not None:
            batch[name] = layout.pad_exact(rollout.column(name))
    baselines = _given_by_every_row(rollout, "baseline_reward")
    if baselines is not None:
        batch["baseline_rewards"] = torch.tensor(baselines, dtype=torch.float32)
    out = make_advantage(ppo_cfg).fn(batch)
    missing = [name for name in (*TOKEN_COLUMNS_OUT, "task_rewards") if name not in out]
    if missing:
        raise ValueError(f"advantage '{ppo_cfg.advantage}' returned no {', '.join(missing)} (advantage_registry.py)")
    table = rollout
    for name in TOKEN_COLUMNS_OUT:
        table = table.append_column(name, layout.unpad(out[name]))
    for name, values in extra.items():
        table = table.append_column(name, pa.array(values, type=pa.list_(pa.float32())))
    table = table.append_column("task_reward", pa.array(out["task_rewards"].float().numpy(), type=pa.float32()))
    return table, advantage_stats(out)


def _given_by_every_row(rollout: pa.Table, name: str) -> Optional[list]:
    """Column `name` where every trajectory has a value, None where none has; a mix is an error."""
    values = rollout.column(name).to_pylist() if name in rollout.column_names else []
    given = sum(value is not None for value in values)
    if 0 < given < len(values):
        raise ValueError(f"the rollout mixes trajectories with {name} ({given}) and without ({len(values) - given}); "
                         "one rollout must produce all of a batch")
    return values if given else None


def write_batch(rollout_dir: Path, out_dir: Path, ppo_cfg, *, run_id: str, iteration: int,
                extra_token_columns: Optional[dict[str, list[list[float]]]] = None,
                rows_per_shard: int = 256) -> dict[str, Any]:
    table, stats = compute_batch(read_table(rollout_dir), ppo_cfg, extra_token_columns)
    return write_table(table, out_dir, run_id=run_id, iteration=iteration, rows_per_shard=rows_per_shard,
                       extra_manifest={"stats": stats}, overwrite=True)


def read_batch(batch_dir: Path, columns: tuple[str, ...]) -> dict[str, list]:
    """The columns the trainer needs, as python lists (one entry per trajectory). A shard that does not match
    its manifest raises CorruptShardError (read_table checks each one): a corrupt batch is never trained on."""
    table = read_table(batch_dir, schema=None)
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise ValueError(f"{batch_dir}: batch shards lack columns {missing}; have {table.column_names}")
    return {c: table.column(c).to_pylist() for c in columns}


def read_logprobs(path: str | Path, input_ids: list[list[int]]) -> list[list[float]]:
    """Per-token logprobs that the trainer's `compute_logp` wrote to `path` for these sequences: IntegrityError
    (a corrupt file, which the pipeline computes again) unless they are one row per sequence, a value per token."""
    import pyarrow.parquet as pq

    from areal_pipeline.checksums import IntegrityError

    try:
        values = pq.read_table(path).column("logprobs").to_pylist()
    except (OSError, KeyError, pa.ArrowException) as error:
        raise IntegrityError(path, f"unreadable logprobs: {error}") from error
    if [len(v) for v in values] != [len(ids) for ids in input_ids]:
        raise IntegrityError(path, f"{len(values)} rows of logprobs do not match the {len(input_ids)} sequences "
                                   "token for token")
    return values
