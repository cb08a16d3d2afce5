"""A line's data: files of rows that arrive over time in `dataset.path`, and what one firing trains on.

    data/                      dataset.path: JSON lines or Parquet files, the data set's own row format
      2026-12-01.jsonl         each file a unit: a firing takes new files whole, in name order
      2026-12-02.parquet
      .2026-12-03.jsonl.tmp    hidden (or *.tmp, *.part): still being written, not seen

A file is identified by its name and a digest of its rows (canonical JSON of each row, in order: the same rows
written again with other spacing or key order are the same file). The ledger's watermark lists every file a
firing used; a file found changed after it was used is an error naming it (`DataChangedError`): its rows were
trained on as they were, and a silent change would make the line's history a lie. Rows whose question is one of
the gate's are never trained on (counted as `gate_overlap`).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from areal_pipeline.config import DatasetConfig, ExperimentConfig, looks_like_local_path
from areal_pipeline.data.datasets import ROW_FILE_SUFFIXES, DatasetError, load_records, read_rows

PARTIAL_SUFFIXES = (".tmp", ".part", ".partial")


class DataChangedError(DatasetError):
    pass


@dataclass(frozen=True)
class DataFile:
    name: str  # relative to the data directory
    sha256: str  # of its rows
    rows: int

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "sha256": self.sha256, "rows": self.rows}


def data_files(directory: Path) -> list[Path]:
    """The complete data files under `directory`, in name order (hidden and partial files are not yet complete)."""
    if not directory.is_dir():
        raise DatasetError(f"dataset.path={str(directory)!r}: a recurring line reads files of rows that arrive in a "
                           "directory; no such directory")
    files = []
    for path in directory.rglob("*"):
        relative = path.relative_to(directory)
        if (path.is_file() and path.suffix in ROW_FILE_SUFFIXES and not path.name.endswith(PARTIAL_SUFFIXES)
                and not any(part.startswith(".") for part in relative.parts)):
            files.append(path)
    return sorted(files, key=lambda p: p.relative_to(directory).as_posix())


def file_rows(path: Path) -> list[dict[str, Any]]:
    return [row for _, row in read_rows(path)]


def rows_digest(rows: list[dict[str, Any]]) -> str:
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str).encode())
        digest.update(b"\n")
    return digest.hexdigest()


def row_id(name: str, index: int, row: dict[str, Any]) -> str:
    """A row's prompt id in the line: its file and its own id (or its index there), unique across the files."""
    return f"{name}:{row['id'] if row.get('id') is not None else index}"


@dataclass
class Window:
    """What a firing trains on: the new files (whole), their rows, rows of earlier files replayed."""
    files: list[DataFile]
    rows: list[dict[str, Any]]  # the new rows, gate overlap left out, each with its line-wide "id"
    replay: list[dict[str, Any]]
    gate_overlap: int
    waiting: list[str]  # new files left for a later firing (recurring.max_rows)

    def record(self) -> dict[str, Any]:
        return {"files": [f.record() for f in self.files], "rows": len(self.rows), "replay_rows": len(self.replay),
                "gate_overlap": self.gate_overlap, "waiting": self.waiting}


def take_window(directory: Path, watermark: dict[str, dict[str, Any]], gate_questions: set[str], *, max_rows: int,
                replay_fraction: float, seed: int) -> Window:
    """The rows of the files not in `watermark` (whole files, oldest name first, up to `max_rows` but at least one
    file), after checking that every file in it is unchanged; and `replay_fraction` of the total drawn from the
    watermark's files' rows, seeded by `seed` (the firing's). DataChangedError names a used file that changed."""
    files = data_files(directory)
    names = {p.relative_to(directory).as_posix(): p for p in files}
    earlier: list[dict[str, Any]] = []
    for name, used in sorted(watermark.items()):
        if name not in names:
            continue  # removed after use: its rows were trained on; nothing of it is replayed
        rows = file_rows(names[name])
        if rows_digest(rows) != used["sha256"]:
            raise DataChangedError(
                f"{names[name]}: changed after firing {used['firing']} of the line trained on it ({used['rows']} rows "
                f"then, {len(rows)} now): restore it, or put the changed rows in a new file")
        earlier.extend(_keyed(name, rows))
    new_files, new_rows, waiting = [], [], []
    for name, path in names.items():
        if name in watermark:
            continue
        if new_files and max_rows and len(new_rows) >= max_rows:
            waiting.append(name)
            continue
        rows = file_rows(path)
        if new_files and max_rows and len(new_rows) + len(rows) > max_rows:
            waiting.append(name)
            continue
        new_files.append(DataFile(name, rows_digest(rows), len(rows)))
        new_rows.extend(_keyed(name, rows))
    fresh = [r for r in new_rows if _question(r) not in gate_questions]
    pool = [r for r in earlier if _question(r) not in gate_questions]
    n_replay = min(len(pool), round(len(fresh) * replay_fraction / (1 - replay_fraction))) if fresh else 0
    replay = random.Random(f"{seed}/replay").sample(pool, n_replay) if n_replay else []
    return Window(new_files, fresh, replay, len(new_rows) - len(fresh), waiting)


def _keyed(name: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**row, "id": row_id(name, i, row)} for i, row in enumerate(rows)]


def _question(row: dict[str, Any]) -> str:
    return str(row.get("question", "")).strip()


def gate_rows(cfg: ExperimentConfig) -> list[dict[str, Any]]:
    """The gate's held-out rows (`recurring.gate_split`): a file of rows, or a split of the data set's own source
    (the generated arithmetic's test split), as rows {"id", "question", "answer"}; its first gate_max_prompts."""
    r = cfg.recurring
    location = r.gate_split
    if Path(location).expanduser().is_file() or location.endswith(ROW_FILE_SUFFIXES) or (
            looks_like_local_path(location) and "/" in location):
        path = Path(location).expanduser()
        if not path.is_file():
            raise DatasetError(f"recurring.gate_split={location!r}: no such file")
        rows = [{**row, "id": f"gate:{row['id'] if row.get('id') is not None else i}"}
                for i, row in enumerate(file_rows(path))]
    else:
        source = DatasetConfig(**{**vars(cfg.dataset), "path": ""})
        try:
            records = load_records(source, location, cfg.seed)
        except DatasetError as error:
            raise DatasetError(f"recurring.gate_split={location!r}: the data set's own {location!r} split: {error}; "
                               "give the gate's rows as a file instead") from None
        rows = [{"id": record["prompt_id"], "question": record["question"], "answer": record["answer"]}
                for record in records]
    if r.gate_max_prompts:
        rows = rows[: r.gate_max_prompts]
    if not rows:
        raise DatasetError(f"recurring.gate_split={location!r}: no rows")
    return rows


def write_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    from areal_pipeline.utils import atomic_write_text

    atomic_write_text(path, "".join(json.dumps(row, ensure_ascii=False, default=str) + "\n" for row in rows))


def iterations_for(rows: int, batch_size: int, configured: int) -> int:
    """A candidate's iterations: `recurring.iterations`, or one pass over its rows."""
    return configured if configured else max(1, math.ceil(rows / batch_size))


def check_dataset_reads_rows(dataset: DatasetConfig) -> Optional[str]:
    """Why the line's data set cannot be trained from files of rows (None where it can)."""
    if dataset.name == "grid":
        return "dataset.name=grid generates its puzzles and reads no rows: a recurring line needs rows from files"
    if not dataset.path:
        return ("dataset.path: empty; a recurring line reads the files of rows that arrive in a directory: name it "
                "(`areal-pipeline recurring demo-data` writes the embedded default's)")
    return None
