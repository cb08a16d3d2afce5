"""The embedded default's incoming data (`areal-pipeline recurring demo-data`): the next file of arithmetic questions
for a line on configs/recurring_cpu.yaml, so that a newcomer can watch a line grow on a laptop. Each file is a
day's worth of questions drawn from the generator's train split (seeded by the file's number: the same command
on another machine writes the same file), never one of the gate's test questions; written under a hidden name
and renamed into place, so a firing never reads half of it."""

from __future__ import annotations

import random
from pathlib import Path

from areal_pipeline.config import DatasetConfig, ExperimentConfig
from areal_pipeline.data.datasets import DatasetError, load_records
from areal_pipeline.recurring.incoming import write_rows

DEMO_ROWS = 160
PREFIX = "day-"


def next_demo_file(directory: Path) -> Path:
    numbers = [int(p.stem[len(PREFIX):]) for p in directory.glob(f"{PREFIX}*.jsonl") if p.stem[len(PREFIX):].isdigit()]
    return directory / f"{PREFIX}{max(numbers, default=0) + 1:04d}.jsonl"


def write_demo_file(cfg: ExperimentConfig, rows: int = DEMO_ROWS) -> tuple[Path, int]:
    """Write the line's next file of `rows` questions into dataset.path; returns it and its row count."""
    if cfg.dataset.name != "arithmetic":
        raise DatasetError(f"demo-data writes the embedded default's arithmetic questions; dataset.name is "
                           f"{cfg.dataset.name!r}: put your own files of rows in dataset.path")
    if not cfg.dataset.path:
        raise DatasetError("dataset.path: empty; name the directory the line's files arrive in")
    if rows < 1:
        raise DatasetError(f"--rows {rows}: must be >= 1")
    directory = Path(cfg.dataset.path).expanduser()
    directory.mkdir(parents=True, exist_ok=True)
    path = next_demo_file(directory)
    source = DatasetConfig(**{**vars(cfg.dataset), "path": ""})
    questions = {r["question"]: r["answer"] for r in load_records(source, source.train_split, cfg.seed)}
    rng = random.Random(f"{cfg.seed}/{path.name}")
    chosen = [rng.choice(sorted(questions)) for _ in range(rows)]
    write_rows(path, [{"question": q, "answer": questions[q]} for q in chosen])
    return path, rows
