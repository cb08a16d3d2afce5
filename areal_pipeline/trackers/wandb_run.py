"""Weights & Biases: one W&B run per project run, its id derived from the run id and the run directory, so that
continuing the run (same run id) resumes the same W&B run. Offline mode writes <dir>/wandb/offline-run-*
(`wandb sync` uploads them; a continued run's directories sync into the one W&B run)."""

from __future__ import annotations

import hashlib
import os
import re
import threading
from pathlib import Path
from typing import Any

# what W&B says a run's status was, per the run's outcome
EXIT_CODES = {"completed": 0, "failed": 1, "cancelled": 255}

# W&B runs opened here and not yet finished: W&B's service process (wandb-core) outlives a finished run, so the
# last one to finish stops it, and nothing of W&B is left running after the run (a later run starts it again)
_open_runs = 0
_open_runs_lock = threading.Lock()


def wandb_run_id(run_id: str, run_dir: Path) -> str:
    """A W&B run id (letters, digits, - and _) for the run: two runs of one id in other output_dirs differ."""
    digest = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_-]+', '-', run_id)[:48]}-{digest}"


class WandbTracker:
    name = "wandb"

    def __init__(self, cfg: Any, run_dir: Path):
        self.cfg, self.run_dir, self.run = cfg, Path(run_dir), None

    def start(self, run_id: str, config: dict[str, Any], links: dict[str, str]) -> str:
        import wandb

        directory = self.cfg.dir or os.environ.get("WANDB_DIR") or str(self.run_dir)
        Path(directory).mkdir(parents=True, exist_ok=True)
        notes = "\n".join(f"{name}: {url}" for name, url in links.items())
        _count_open(+1)
        try:
            self.run = wandb.init(project=self.cfg.project, entity=self.cfg.entity or None, mode=self.cfg.mode,
                                  dir=directory, id=wandb_run_id(run_id, self.run_dir), name=run_id, resume="allow",
                                  tags=[run_id, *self.cfg.tags], notes=notes or None,
                                  config={**config, "links": dict(links)}, reinit="create_new",
                                  settings=wandb.Settings(console="off", silent=True))
        except BaseException:
            _count_open(-1)
            raise
        return self.run.url or self.run.settings.sync_dir

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def finish(self, status: str) -> None:
        if self.run is None:
            return
        try:
            self.run.finish(exit_code=EXIT_CODES.get(status, 1))
        finally:
            self.run = None
            _count_open(-1)


def _count_open(change: int) -> None:
    global _open_runs
    with _open_runs_lock:
        _open_runs += change
        if _open_runs == 0:
            import wandb

            wandb.teardown()
