"""The records of the traffic log (traffic_log.py): the fields of a chat completion's record (one per choice) and of
a feedback record, their Parquet schemas, and the canonical JSON whose sha256 checks a journal line and a shard."""

from __future__ import annotations

import hashlib
import json
import numbers
import os
import re
import struct
import time
from typing import Any, Iterable, Optional

import pyarrow as pa

KINDS = ("requests", "feedback")
REQUEST_SCHEMA = pa.schema([
    ("sample_id", pa.string()), ("response_id", pa.string()), ("choice", pa.int32()),
    ("conversation_id", pa.string()), ("created_at", pa.float64()), ("server", pa.string()),
    ("model", pa.string()), ("version", pa.int64()), ("prompt_ids", pa.list_(pa.int32())),
    ("completion_ids", pa.list_(pa.int32())), ("logprobs", pa.list_(pa.float64())),
    ("versions", pa.list_(pa.int64())), ("finish_reason", pa.string()), ("messages", pa.string()),
    ("tools", pa.string()), ("reply", pa.string()), ("temperature", pa.float64()), ("top_p", pa.float64()),
    ("max_tokens", pa.int64()), ("prompt_sha256", pa.string()),
])  # fmt: skip
FEEDBACK_SCHEMA = pa.schema([
    ("feedback_id", pa.string()), ("response_id", pa.string()), ("conversation_id", pa.string()),
    ("reward", pa.float64()), ("comment", pa.string()), ("received_at", pa.float64()), ("server", pa.string()),
])  # fmt: skip
REQUEST_FIELDS = tuple(REQUEST_SCHEMA.names)
FEEDBACK_FIELDS = tuple(FEEDBACK_SCHEMA.names)
SCHEMAS = {"requests": REQUEST_SCHEMA, "feedback": FEEDBACK_SCHEMA}
ID_FIELD = {"requests": "sample_id", "feedback": "feedback_id"}
TIME_FIELD = {"requests": "created_at", "feedback": "received_at"}


def canonical_json(record: dict) -> str:
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def record_sha256(record: dict) -> str:
    return hashlib.sha256(canonical_json(record).encode("utf-8")).hexdigest()


def content_sha256(records: Iterable[dict]) -> str:
    """A shard's checksum: over its records' canonical JSON, one line each, in order."""
    h = hashlib.sha256()
    for record in records:
        h.update(canonical_json(record).encode("utf-8") + b"\n")
    return h.hexdigest()


def prompt_sha256(prompt_ids: list[int]) -> str:
    """The prompt's identity across requests: the sha256 of its ids as little-endian int64s."""
    return hashlib.sha256(struct.pack(f"<{len(prompt_ids)}q", *prompt_ids)).hexdigest()


def writer_name(host: str, port: int, pid: Optional[int] = None, started_ms: Optional[int] = None) -> str:
    """One server process's name in file names: `{host}_{port}-{pid}-{start_unix_ms}`, in [A-Za-z0-9_.-]."""
    pid = os.getpid() if pid is None else pid
    started_ms = int(time.time() * 1000) if started_ms is None else started_ms
    return sanitized_name(f"{host}_{port}-{pid}-{started_ms}")


def sanitized_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)


def normalized(record: dict, kind: str) -> dict:
    """`record` with exactly the fields of `kind`, each of its schema's Python type: what a shard gives back, so that
    the checksum of a journal's records and of the shard sealed from them agree (an int temperature would not)."""
    schema = SCHEMAS[kind]
    missing, unknown = sorted(set(schema.names) - set(record)), sorted(set(record) - set(schema.names))
    if missing or unknown:
        raise ValueError(f"a {kind} record needs exactly the fields {', '.join(schema.names)}; missing {missing}, "
                         f"unknown {unknown}")
    out = {}
    for field in schema:
        value = record[field.name]
        if pa.types.is_list(field.type):
            if not isinstance(value, (list, tuple)):
                raise ValueError(f"{kind} record field {field.name!r} must be a list, got {type(value).__name__}")
            out[field.name] = [_scalar(field.name, field.type.value_type, v) for v in value]
        else:
            out[field.name] = _scalar(field.name, field.type, value)
    return out


def _scalar(name: str, kind: pa.DataType, value: Any) -> Any:
    if pa.types.is_string(kind) and isinstance(value, str):
        return value
    if pa.types.is_integer(kind) and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if pa.types.is_floating(kind) and isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    raise ValueError(f"record field {name!r} must be {kind}, got {value!r}")
