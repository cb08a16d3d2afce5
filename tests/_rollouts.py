"""What two runs of the same iterations must share: their episodes, compared as a rerun promises them; and what an
iteration's episode journal holds, read as Arrow reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import torch

from areal_pipeline.data.shards import read_table

# Bitwise: what the seeds decide (the tokens sampled, the masks, the versions, the rewards)
SAME_BITS = ("prompt_id", "sample_idx", "input_ids", "loss_mask", "versions", "reward")


def assert_same_episodes(run_dir: Path, reference: Path, iterations) -> None:
    """Iterations `iterations` of `run_dir` played the episodes `reference` played: bitwise, except the sampled
    tokens' logprobs, to 1e-5. The project's CPU server is not batch invariant: a request is prefilled and decoded in
    whichever batch the requests that arrived with it make, and rows of another width round differently (~1e-6),
    and arrival times differ between any two runs, interrupted or not. (A run that trains on them, without
    ppo.recompute_logprob, is then not bitwise either.)"""
    for k in iterations:
        mine, theirs = (read_table(d / f"iter_{k}" / "rollout") for d in (run_dir, reference))
        for column in SAME_BITS:
            assert mine.column(column).to_pylist() == theirs.column(column).to_pylist(), (k, column)
        for a, b in zip(mine.column("logprobs").to_pylist(), theirs.column("logprobs").to_pylist()):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=0), k


def journal_records(segment: Path) -> list[tuple[dict, int]]:
    """(record, rows) of each record of an episode journal's segment, in order, up to a torn tail or the end of
    what its writer has appended so far."""
    out = []
    with pa.OSFile(str(segment)) as source:
        try:
            reader = pa.ipc.open_stream(source)
        except (pa.ArrowInvalid, OSError):  # not even the schema written yet
            return out
        while True:
            try:
                batch, custom = reader.read_next_batch_with_custom_metadata()
            except (StopIteration, pa.ArrowInvalid, OSError):  # the end, or a torn tail
                return out
            out.append((json.loads(custom[b"areal_pipeline.group"]), batch.num_rows))


def journaled_positions(directory: Path) -> set[int]:
    """The batch positions with a group in an episode journal's segments (directory: iter_k/rollout.episodes)."""
    return {meta["slot"] for segment in sorted(Path(directory).glob("segment-*.arrows"))
            for meta, _ in journal_records(segment) if not meta.get("discarded")}
