"""The live pipelines of this process, by run id, and the cache keys that tie task results to disk outputs."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Callable, Optional

from areal_pipeline.data.shards import shards_intact
from areal_pipeline.pipeline import Pipeline
from areal_pipeline.utils import deadline

_PIPELINES: dict[str, Pipeline] = {}


def register(pipeline: Pipeline) -> None:
    _PIPELINES[pipeline.cfg.run_id] = pipeline


def unregister(run_id: str) -> None:
    _PIPELINES.pop(run_id, None)


def get(run_id: str) -> Pipeline:
    try:
        return _PIPELINES[run_id]
    except KeyError:
        raise RuntimeError(f"run '{run_id}' has no live pipeline in this process (tasks run inside the train "
                           "flow, which starts the servers and the trainer)") from None


def run_node(name: str, run_id: str, k: int, limit_s: float) -> Any:
    """`Pipeline.<name>(k)` of run `run_id`, within `limit_s` seconds: every trainer command, inference request
    and wait inside it is bounded by what is left (`utils.deadline`), and running past the limit fails the node
    (which its retries then handle). Not Prefect's `timeout_seconds`: iteration runs execute in worker threads,
    where it cannot interrupt a blocked call, warns on every task run and starts a watcher thread per task."""
    with deadline(limit_s, f"{name} of iteration {k}"):
        return getattr(get(run_id), name)(k)


def output_cache_key(output: Callable[[Pipeline, int], Path]) -> Callable[[Any, dict], Optional[str]]:
    """A Prefect `cache_key_fn` that exists only while the node's output is complete and intact on disk: the
    key is the digest of the output's manifest/record, so deleting or rewriting the output invalidates the
    cache, and a node whose output is missing, or whose shards fail their checksums, always runs (and finds
    the corruption itself). The check (it reads and hashes the manifest) runs only where an output exists: on a
    rerun, not a first run."""

    def key(context, parameters: dict) -> Optional[str]:
        pipeline = _PIPELINES.get(parameters["run_id"])
        if pipeline is None:
            return None
        path = output(pipeline, parameters["k"])
        record = path / "manifest.json" if path.is_dir() else path
        if not record.is_file() or (path.is_dir() and not shards_intact(path)):
            return None
        digest = hashlib.sha256(record.read_bytes()).hexdigest()[:16]
        return f"{context.task.name}-{pipeline.cfg.run_id}-{parameters['k']}-{digest}"

    return key


def retry_while_running(task, task_run, state) -> bool:
    """A `retry_condition_fn`: retry a failed node only for a transient fault (`errors.is_transient`: a lost
    connection, a timeout, a process that died, HTTP 5xx) and only while its run goes on. A deterministic error
    (bad config or data, a missing file, a request refused as bad) fails at once, its own message last, not
    under retry tracebacks; once the run is ending (its services stopped, e.g. after Ctrl-C), a node that failed
    because of it gives up at once too."""
    from prefect.context import TaskRunContext

    from areal_pipeline.errors import is_transient

    failure = state.data  # Prefect hands the node's exception over as a Failed state's data
    if isinstance(failure, BaseException) and not is_transient(failure):
        return False
    context = TaskRunContext.get()
    run_id = context.parameters.get("run_id") if context is not None and context.parameters else None
    pipeline = _PIPELINES.get(run_id) if run_id is not None else None
    return pipeline is not None and not pipeline.services.stopped
