"""File integrity: sha256 + byte size of files, recorded when they are written and checked before they are used.

Two manifests use it: a shard directory's `manifest.json` (data/shards.py) and a checkpoint's `checksums.json`
(written here, last and atomically, after every other file of the checkpoint):

    runs/<run>/checkpoints/step_<k>/checksums.json   {"format": 1, "files": {"model/model.safetensors":
                                                      {"bytes": 3301504, "sha256": "9f2c..."}, ...}}

A file that fails a check raises `IntegrityError`, whose message names the file and what failed: a missing
manifest, a missing file, a size mismatch (a truncated or overwritten file) or a sha256 mismatch.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable, Optional

from areal_pipeline.utils import atomic_write_text

CHECKSUMS_NAME = "checksums.json"
CHECKSUMS_FORMAT = 1
_MISSING = "missing file (listed in the manifest)"


class IntegrityError(RuntimeError):
    """A file that does not match its manifest (or a manifest that is missing or unreadable)."""

    def __init__(self, path: str | os.PathLike, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = Path(path), problem


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_entry(data: bytes) -> dict[str, Any]:
    """What a manifest records of a file with these contents."""
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def verify_file(path: Path, entry: dict[str, Any]) -> None:
    """Raise IntegrityError unless `path` has the size and sha256 of its manifest `entry` (hashed as a stream,
    for files of any size)."""
    if not path.is_file():
        raise IntegrityError(path, _MISSING)
    _compare(path, path.stat().st_size, lambda: sha256_file(path), entry)


def read_verified(path: Path, entry: dict[str, Any]) -> bytes:
    """The contents of `path`, once they match its manifest `entry`. Read once: the bytes checked are the bytes
    the caller uses."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise IntegrityError(path, _MISSING) from None
    _compare(path, len(data), lambda: hashlib.sha256(data).hexdigest(), entry)
    return data


def _compare(path: Path, size: int, sha256: Callable[[], str], entry: dict[str, Any]) -> None:
    if size != entry["bytes"]:  # before hashing: a truncated file needs none
        raise IntegrityError(path, f"size {size} != manifest {entry['bytes']} (truncated or overwritten)")
    if sha256() != entry["sha256"]:
        raise IntegrityError(path, "sha256 mismatch with the manifest (the contents changed: corrupted or replaced)")


def write_checksums(directory: Path) -> dict[str, Any]:
    """Record every file under `directory` (relative paths) in its `checksums.json`. Call it after the last
    other file is written: the manifest's presence is what says the directory is whole."""
    directory = Path(directory)
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != CHECKSUMS_NAME):
        files[path.relative_to(directory).as_posix()] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    manifest = {"format": CHECKSUMS_FORMAT, "files": files}
    atomic_write_text(directory / CHECKSUMS_NAME, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def has_checksums(directory: Path) -> bool:
    """Whether the write of `directory` finished (its manifest is written last); says nothing of its contents."""
    return (Path(directory) / CHECKSUMS_NAME).is_file()


def verify_checksums(directory: Path, under: Optional[str] = None) -> None:
    """Check the files recorded in `directory`'s checksums.json (all of them, or those under the subdirectory
    `under`) against their sizes and sha256s; IntegrityError names the first that fails."""
    directory = Path(directory)
    manifest_path = directory / CHECKSUMS_NAME
    if not manifest_path.is_file():
        raise IntegrityError(manifest_path, "missing manifest: the save did not finish, or this directory was "
                                            "written without checksums")
    try:
        files = json.loads(manifest_path.read_text(encoding="utf-8"))["files"]
    except (ValueError, KeyError, TypeError) as e:
        raise IntegrityError(manifest_path, f"unreadable manifest ({e})") from None
    listed = {name: entry for name, entry in files.items() if under is None or name.startswith(f"{under}/")}
    if not listed:
        raise IntegrityError(directory / (under or ""), f"no files listed in {CHECKSUMS_NAME}")
    for name, entry in listed.items():
        verify_file(directory / name, entry)
