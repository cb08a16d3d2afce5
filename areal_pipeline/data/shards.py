"""Trajectories <-> Parquet shards: one directory per pipeline stage output, one row per trajectory.

    out/part-00000.parquet, part-00001.parquet, ...   each written atomically (hidden temp name, then rename)
    out/manifest.json                                 written last: row counts, sizes, sha256s

A directory without a manifest is an unfinished write, never a result: `is_complete` says False and the
readers raise `ShardError`. The readers check every shard against the manifest (size, sha256, rows) as they
read it, so a corrupt shard is never used: `CorruptShardError` names the file and what failed. (Hashing a shard
costs little beside reading it, so every read is checked.) `messages`
and `metadata` are JSON strings, so any Parquet reader can open the shards without this package.

Reading with other tools. `manifest.json` sits next to the parts and pyarrow's directory discovery
tries to read it as Parquet, so pass the part files, not the directory, to pandas:
    pd.read_parquet(part_files(out_dir))
    duckdb.sql(f"select * from '{out_dir}/part-*.parquet'")
    datasets.load_dataset("parquet", data_files=part_files(out_dir), split="train")
(Hidden temporary files of an interrupted write never match `part-*.parquet`.)
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import pyarrow.parquet as pq

from areal_pipeline.checksums import IntegrityError, file_entry, read_verified
from areal_pipeline.data.trajectory import Trajectory
from areal_pipeline.utils import atomic_write_bytes, atomic_write_text, get_logger

logger = get_logger(__name__)

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
_MANIFEST_KEYS = {"schema_version", "run_id", "iteration", "num_rows", "shards", "created_at"}

TRAJECTORY_SCHEMA = pa.schema(
    [
        ("run_id", pa.string()),
        ("iteration", pa.int32()),
        ("prompt_id", pa.string()),
        ("group_id", pa.string()),
        ("sample_idx", pa.int32()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("logprobs", pa.list_(pa.float32())),
        ("versions", pa.list_(pa.int32())),
        ("reward", pa.float32()),
        ("num_turns", pa.int16()),
        ("stop_reason", pa.string()),
        ("messages", pa.string()),
        ("text", pa.string()),
        ("metadata", pa.string()),
        # Nullable and last: shards written before they existed read back with nulls (no schema_version bump).
        ("token_returns", pa.list_(pa.float32())),
        ("baseline_reward", pa.float32()),
        ("step_states", pa.list_(pa.int64())),
        ("step_rewards", pa.list_(pa.float32())),
    ]
)

# Columns that map one-to-one onto `Trajectory` fields (messages/metadata go through JSON).
_TRAJECTORY_COLUMNS = (
    "prompt_id", "group_id", "sample_idx", "input_ids", "loss_mask", "logprobs", "versions",
    "reward", "num_turns", "stop_reason", "text", "token_returns", "baseline_reward", "step_states", "step_rewards",
)  # fmt: skip


class ShardError(RuntimeError):
    pass


class CorruptShardError(ShardError, IntegrityError):
    """A shard listed in the manifest that is missing or does not match it (size, sha256 or rows)."""


def write_shards(
    trajectories: list[Trajectory],
    out_dir: str | os.PathLike,
    *,
    run_id: str,
    iteration: int,
    rows_per_shard: int = 256,
    extra_manifest: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """Write trajectories as `part-*.parquet` then `manifest.json`; return the manifest.

    A complete earlier output is kept (ShardError) unless `overwrite`; leftovers of an unfinished write
    are always cleared, so a retried task simply writes again.
    """
    return write_table(_to_table(trajectories, run_id, iteration), out_dir, run_id=run_id, iteration=iteration,
                       rows_per_shard=rows_per_shard, extra_manifest=extra_manifest, overwrite=overwrite)


def write_table(
    table: pa.Table,
    out_dir: str | os.PathLike,
    *,
    run_id: str,
    iteration: int,
    rows_per_shard: int = 256,
    extra_manifest: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """`write_shards` for any table (e.g. trajectories plus the advantages step's columns)."""
    if rows_per_shard < 1:
        raise ValueError(f"rows_per_shard must be >= 1, got {rows_per_shard}")
    out = Path(out_dir)
    if is_complete(out) and not overwrite:
        raise ShardError(f"{out} already holds complete shards (manifest.json); pass overwrite=True to replace them")
    clashes = sorted(set(extra_manifest or {}) & _MANIFEST_KEYS)
    if clashes:
        raise ValueError(f"extra_manifest may not set the manifest's own keys: {', '.join(clashes)}")
    _clear(out)
    out.mkdir(parents=True, exist_ok=True)

    # An empty output still gets one (empty) shard so every reader sees the schema.
    offsets = list(range(0, table.num_rows, rows_per_shard)) or [0]
    shards = []
    for k, offset in enumerate(offsets):
        name = f"part-{k:05d}.parquet"
        chunk = table.slice(offset, rows_per_shard)
        # Serialised in memory, so the checksum is of exactly the bytes that are renamed into place.
        sink = pa.BufferOutputStream()
        pq.write_table(chunk, sink)
        data = sink.getvalue().to_pybytes()
        atomic_write_bytes(out / name, data)
        shards.append({"file": name, "rows": chunk.num_rows, **file_entry(data)})

    manifest = {
        "schema_version": SCHEMA_VERSION,
        "run_id": run_id,
        "iteration": iteration,
        "num_rows": table.num_rows,
        "shards": shards,
        "created_at": datetime.now(timezone.utc).isoformat(),
        **(extra_manifest or {}),
    }
    atomic_write_text(out / MANIFEST_NAME, json.dumps(manifest, indent=2) + "\n")
    return manifest


def _clear(out: Path) -> None:
    # The manifest goes first: a crash while clearing must not leave a manifest over missing parts.
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    # Hidden temp files are what a killed writer leaves behind (see utils.atomic_write_bytes).
    for pattern in ("part-*.parquet", ".part-*.parquet.tmp-*", f".{MANIFEST_NAME}.tmp-*"):
        for stale in out.glob(pattern):
            stale.unlink(missing_ok=True)


def trajectory_table(trajectories: list[Trajectory], run_id: str, iteration: int) -> pa.Table:
    """Trajectories as a table of TRAJECTORY_SCHEMA (the rows `write_shards` writes)."""
    return _to_table(trajectories, run_id, iteration)


def with_stored_rewards(trajectories: list[Trajectory], table: pa.Table) -> list[Trajectory]:
    """`trajectories` with their rewards as `table` (their `trajectory_table`) stores them, in float32: the
    figures computed from them are a shard reader's, without reading every column back (`table_trajectories`)."""
    stored = []
    for t, reward, baseline in zip(trajectories, table.column("reward").to_pylist(),
                                   table.column("baseline_reward").to_pylist(), strict=True):
        t = copy.copy(t)  # shallow: the token lists are shared, not copied
        t.reward, t.baseline_reward = reward, baseline
        stored.append(t)
    return stored


# What differs between any two runs of the same episodes: the run's name, the servers' timing and address. The
# content digest leaves them out, so that a rerun's rollout can be compared with an uninterrupted one's.
VOLATILE_COLUMNS = ("run_id",)
VOLATILE_METADATA = ("latency", "server")


def content_sha256(table: pa.Table) -> str:
    """sha256 of a rollout table's episodes: every column but VOLATILE_COLUMNS, each row's metadata without
    VOLATILE_METADATA. Equal digests mean equal tokens, logprobs, versions, rewards and texts, row for row."""
    digest = hashlib.sha256()
    for name in table.column_names:
        if name in VOLATILE_COLUMNS:
            continue
        values = table.column(name).to_pylist()
        if name == "metadata":
            values = [_without_volatile(value) for value in values]
        digest.update(json.dumps([name, values], ensure_ascii=False,
                                 separators=(",", ":")).encode("utf-8"))
    return digest.hexdigest()


def _without_volatile(metadata: str | None) -> Any:
    if metadata is None:
        return None
    record = json.loads(metadata)
    return {key: value for key, value in record.items() if key not in VOLATILE_METADATA} if isinstance(
        record, dict) else record


def _to_table(trajectories: list[Trajectory], run_id: str, iteration: int) -> pa.Table:
    columns: dict[str, list] = {name: [getattr(t, name) for t in trajectories] for name in _TRAJECTORY_COLUMNS}
    columns["run_id"] = [run_id] * len(trajectories)
    columns["iteration"] = [iteration] * len(trajectories)
    columns["messages"] = [json.dumps(t.messages, ensure_ascii=False) for t in trajectories]
    columns["metadata"] = [json.dumps(t.metadata, ensure_ascii=False, sort_keys=True) for t in trajectories]
    return pa.Table.from_pydict(columns, schema=TRAJECTORY_SCHEMA)


def read_manifest(out_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(out_dir) / MANIFEST_NAME
    if not path.is_file():
        raise ShardError(
            f"{out_dir}: no {MANIFEST_NAME}, so the shards are incomplete (the write did not finish) "
            "or this is not a shard directory"
        )
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ShardError(f"{path}: invalid JSON ({e})") from None
    if manifest.get("schema_version") != SCHEMA_VERSION:
        raise ShardError(
            f"{path}: schema_version {manifest.get('schema_version')!r}, this code reads {SCHEMA_VERSION}"
        )
    return manifest


def has_manifest(out_dir: str | os.PathLike) -> bool:
    """Whether the write finished (the manifest is written last); says nothing of the shards' contents."""
    return (Path(out_dir) / MANIFEST_NAME).is_file()


def is_complete(out_dir: str | os.PathLike) -> bool:
    """Manifest present and every listed shard on disk at its listed size (no hashing: cheap). Whether the
    contents are intact is for `verify_shards` and the readers, which hash."""
    try:
        manifest = read_manifest(out_dir)
    except ShardError:
        return False
    for shard in manifest["shards"]:
        path = Path(out_dir) / shard["file"]
        if not path.is_file() or path.stat().st_size != shard["bytes"]:
            return False
    return True


def part_files(out_dir: str | os.PathLike) -> list[str]:
    """The shard paths in order, for readers that take a file list (pandas, `datasets`)."""
    return [str(Path(out_dir) / shard["file"]) for shard in read_manifest(out_dir)["shards"]]


def verify_shards(out_dir: str | os.PathLike) -> None:
    """Check every shard's size, sha256 and row count against the manifest (CorruptShardError names the
    first that fails)."""
    manifest = read_manifest(out_dir)
    total = 0
    for path, shard, data in _verified_shards(out_dir, manifest):
        total += _check_rows(path, shard, pq.ParquetFile(pa.BufferReader(data)).metadata.num_rows)
    if total != manifest["num_rows"]:
        raise ShardError(f"{out_dir}: shards hold {total} rows, the manifest says {manifest['num_rows']}")


def shards_intact(out_dir: str | os.PathLike) -> bool:
    """Whether `out_dir` holds a finished write whose shards match their manifest (`verify_shards`)."""
    return _shard_problem(out_dir) is None


def keep_if_intact(out_dir: str | os.PathLike) -> bool:
    """For a step that can compute its output again: True when `out_dir` holds shards that match their manifest.
    Otherwise there is nothing to keep: a corrupt output is logged (naming the file and what failed) and
    cleared, so that the step writes it afresh; an unfinished one (no manifest) is left to the writer."""
    if not has_manifest(out_dir):
        return False
    problem = _shard_problem(out_dir)
    if problem is not None:
        logger.warning("corrupt output, computing it again: %s", problem)
        _clear(Path(out_dir))
    return problem is None


def _shard_problem(out_dir: str | os.PathLike) -> ShardError | None:
    try:
        verify_shards(out_dir)
        return None
    except ShardError as error:
        return error


def read_table(out_dir: str | os.PathLike, schema: pa.Schema | None = TRAJECTORY_SCHEMA) -> pa.Table:
    """All shards, in order, as one table (with `schema`; None: the files' own, e.g. batch shards). Each shard
    is checked against the manifest as it is read: a corrupt one raises CorruptShardError, never data."""
    tables = []
    for path, shard, data in _verified_shards(out_dir, read_manifest(out_dir)):
        try:
            table = pq.read_table(pa.BufferReader(data), schema=schema)
        except pa.ArrowException as e:
            raise ShardError(f"{path}: unreadable shard ({e})") from e
        _check_rows(path, shard, table.num_rows)
        tables.append(table)
    return pa.concat_tables(tables)


def _verified_shards(out_dir: str | os.PathLike, manifest: dict) -> Iterator[tuple[Path, dict, bytes]]:
    """(path, manifest entry, contents) of each shard in order, its size and sha256 checked (the bytes that
    were hashed are the bytes that are parsed)."""
    for shard in manifest["shards"]:
        path = Path(out_dir) / shard["file"]
        try:
            data = read_verified(path, shard)
        except IntegrityError as error:
            raise CorruptShardError(path, error.problem) from None
        yield path, shard, data


def _check_rows(path: Path, shard: dict, rows: int) -> int:
    if rows != shard["rows"]:
        raise CorruptShardError(path, f"{rows} rows != manifest {shard['rows']}")
    return rows


def read_trajectories(out_dir: str | os.PathLike) -> list[Trajectory]:
    return table_trajectories(read_table(out_dir))


def table_trajectories(table: pa.Table) -> list[Trajectory]:
    """The trajectories of a table of TRAJECTORY_SCHEMA (the inverse of `trajectory_table`, float32 values and
    all)."""
    columns = table.to_pydict()
    n = len(columns["prompt_id"])
    return [
        Trajectory(
            **{name: columns[name][i] for name in _TRAJECTORY_COLUMNS},
            messages=json.loads(columns["messages"][i]),
            metadata=json.loads(columns["metadata"][i]),
        )
        for i in range(n)
    ]
