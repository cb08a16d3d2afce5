"""The passes of the trainer's models over an iteration's tokens that the algorithm needs beside the update, as
steps of their own (steps.py): the frozen reference model's logprobs (the KL penalty) and policy k - 1's logprobs
of the batch (the decoupled loss's proximal policy, or the recomputed "old" logprobs, where the update has several
minibatches). Each writes one Parquet file (a `logprobs` list column, a row per trajectory, written atomically by
the trainer's `compute_logp`), and returns a record naming it; one already written for the same shards is kept.

`LogprobSteps` is the part of `Pipeline` that does this (a mixin: it reads the pipeline's config, paths,
services, trainer lock and policy versions).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

from areal_pipeline.data.shards import read_manifest
from areal_pipeline.steps import proximal_logprobs_path, ref_logprobs_path, timed


def logprobs_rows(path: Path) -> Optional[int]:
    """The rows of a finished logprobs file, None where there is none (or it cannot be read)."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows if path.is_file() else None
    except Exception:  # a damaged file: the step writes it again
        return None


class LogprobSteps:
    def _logprobs(self, shards: Path, out: Path, model: str, version: Optional[int]) -> dict[str, Any]:
        """`model`'s logprobs of the tokens of `shards` -> `out` (the actor at `version`), unless `out` holds them."""
        rows = read_manifest(shards)["num_rows"]
        if logprobs_rows(out) == rows:
            return {"path": str(out), "rows": rows, "cached": True}
        started = time.perf_counter()
        with self._trainer_lock:
            client = (self.services.ensure_trainer_alive() if version is None
                      else self.ensure_trainer_version(version))
            client.call("compute_logp", shard_dir=str(shards), out_path=str(out), model=model)
        return {"path": str(out), "rows": rows, "seconds": time.perf_counter() - started, "cached": False}

    def _reference_logprobs(self, k: int, episodes: Optional[dict] = None) -> dict[str, Any]:
        shards = Path(episodes["shards"]) if episodes else self.paths.rollout(k)
        return self._logprobs(shards, ref_logprobs_path(self.paths, k), "ref", None)

    @timed
    def ref_logprobs(self, k: int, episodes: Optional[dict] = None) -> dict[str, Any]:
        """The reference model's logprobs of iteration k's rollout (`episodes`: the rollout step's record)."""
        return self._reference_logprobs(k, episodes)

    @timed
    def proximal_logprobs(self, k: int, batch: Optional[dict] = None) -> dict[str, Any]:
        """Policy k - 1's logprobs of iteration k's batch (`batch`: the advantages step's record): the trainer is
        brought to version k - 1 first, as for the update."""
        shards = Path(batch["shards"]) if batch else self.paths.batch(k)
        return self._logprobs(shards, proximal_logprobs_path(self.paths, k), "actor", k - 1)
