"""TensorBoard: the metrics as event files in <run_dir>/tensorboard (`tensorboard --logdir <run_dir>`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class TensorBoardTracker:
    name = "tensorboard"

    def __init__(self, log_dir: Path):
        self.log_dir = Path(log_dir)
        self.writer = None

    def start(self, run_id: str, config: dict[str, Any], links: dict[str, str]) -> str:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(self.log_dir))
        self.writer.add_text("links", "\n\n".join(f"{name}: {url}" for name, url in links.items()) or "-")
        return str(self.log_dir)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a reader sees each iteration as it comes, not at the end

    def finish(self, status: str) -> None:
        if self.writer is not None:
            self.writer.close()
