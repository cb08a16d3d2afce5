"""Torch profiler tables of the trainer's updates, for finding where an update's time goes: one file per update and
rank, where AREAL_TRAINER_PROFILE names a directory (AREAL_TRAINER_PROFILE_ITERATIONS: the iterations,
comma-separated; unset: every one)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from areal_pipeline.utils import atomic_path

PROFILE_ENV = "AREAL_TRAINER_PROFILE"
PROFILE_ITERATIONS_ENV = "AREAL_TRAINER_PROFILE_ITERATIONS"


def profile_path(iteration: int, rank: int) -> Optional[Path]:
    """Where the update of `iteration` on `rank` writes its table, or None when it is not profiled."""
    profile_dir = os.environ.get(PROFILE_ENV)
    wanted = os.environ.get(PROFILE_ITERATIONS_ENV, "")
    if not profile_dir or (wanted and str(iteration) not in wanted.split(",")):
        return None
    return Path(profile_dir) / f"train-iter{iteration}-rank{rank}.txt"


def profiled(out: Path, device: torch.device, command: Callable[[], Any]) -> Any:
    """`command()` under torch's profiler; its operators by time (self device time on a GPU) go to `out`."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        result = command()
        if on_gpu:
            torch.cuda.synchronize()
    out.parent.mkdir(parents=True, exist_ok=True)
    sort = "self_cuda_time_total" if on_gpu else "self_cpu_time_total"
    with atomic_path(out) as tmp:
        Path(tmp).write_text(prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=60))
    return result
