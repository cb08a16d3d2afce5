"""The DAG's nodes as Prefect tasks, one per step of `areal_pipeline.steps.STEPS` (its order, inputs, retries,
time limit and cached output).

A node `<step>(run, k, *inputs)` is `Pipeline.<step>(k, *inputs)` within its time limit. `run` is the run's context
(`areal_pipeline.run_context.RunContext.to_dict()`: its directory and its services' addresses): where the run is live
in the node's process (the train flow's own) the node uses its live pipeline, elsewhere (a new process, a Prefect
worker on another host) a pipeline attached to the run's services (`tasks.runs.pipeline_for`); a node is handed
everything it needs. Its inputs are the outputs (small JSON records naming files) of the steps it names, so the
Prefect UI draws the data edges. `call_node` calls one from a flow: the context and k are quoted (they are no
upstream result, whatever object identity says) and each input is opaque (its own node is the edge, not the
objects inside it), since Prefect links an argument to the task run whose result has the same `id()`.

Retries are for transient faults only, and only while the run goes on (`retry_while_running`). A node whose
output is a directory of shards or a file is cached by that output (`output_cache_key`): a rerun or a retried
train run shows it Cached and skips it while the output is complete and intact on disk.
"""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path
from typing import Any, Callable, Optional

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.utilities.annotations import opaque, quote

from areal_pipeline.data.shards import shards_intact
from areal_pipeline.logprob_steps import logprobs_rows
from areal_pipeline.run_context import RunContext, run_node
from areal_pipeline.steps import STEPS, Step
from tasks import runs


def run_step(name: str, run: dict, k: int, inputs: tuple) -> Any:
    """`Pipeline.<name>(k, *inputs)` of the run whose context is `run`, within the step's time limit
    (`run_context.run_node`; its retries handle a node that ran past it). Not Prefect's `timeout_seconds`: iteration
    runs execute in worker threads, where it cannot interrupt a blocked call, warns on every task run and starts a
    watcher thread per task."""
    return run_node(runs.pipeline_for(RunContext.from_dict(run)), name, k, inputs)


def output_cache_key(output: Callable[[Any, int], Path]) -> Callable[[Any, dict], Optional[str]]:
    """A Prefect `cache_key_fn` that exists only while the node's output (`output(run paths, k)`) is complete and
    intact on disk: the key is the digest of the output's manifest (or of the output file itself), so deleting
    or rewriting the output invalidates the cache, and a node whose output is missing, or whose shards fail their
    checksums, always runs (and finds the corruption itself). The check (it reads and hashes the manifest) runs
    only where an output exists: on a rerun, not a first run."""

    def key(context, parameters: dict) -> Optional[str]:
        run = RunContext.from_dict(_plain(parameters["run"]))
        k = _plain(parameters["k"])
        path = output(run.paths, k)
        record = path / "manifest.json" if path.is_dir() else path
        if not record.is_file() or (path.is_dir() and not shards_intact(path)) or (
                path.suffix == ".parquet" and logprobs_rows(path) is None):  # a logprobs file that cannot be read
            return None
        # the run's directory too: two runs of one run id (another output_dir) never share a cached record
        digest = hashlib.sha256(run.run_dir.encode() + b"\0" + record.read_bytes()).hexdigest()[:16]
        return f"{context.task.name}-{run.run_id}-{k}-{digest}"

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
    parameters = context.parameters if context is not None and context.parameters else {}
    if "run" in parameters:  # a node: its run's context
        return runs.goes_on(RunContext.from_dict(_plain(parameters["run"])))
    # a set-up node (tasks/setup.py): it runs in the process that owns the run
    run = runs.find(_plain(parameters["run_id"])) if "run_id" in parameters else None
    return run is not None and not run.pipeline.services.stopped


def _plain(value: Any) -> Any:
    """A parameter as the task got it (`call_node` quotes some)."""
    return value.unwrap() if isinstance(value, (quote, opaque)) else value


def _node_task(step: Step):
    # the inputs named by their steps (Prefect records each parameter's upstream task run)
    signature = inspect.Signature(
        [inspect.Parameter("run", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=dict),
         inspect.Parameter("k", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=int)]
        + [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None) for name in step.inputs])

    def run(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        parameters = bound.arguments
        return run_step(step.name, parameters["run"], parameters["k"], tuple(parameters[name] for name in step.inputs))

    run.__name__ = run.__qualname__ = step.name
    run.__doc__ = step.doc
    run.__signature__ = signature
    # a node without an output on disk runs every time it is called (it is idempotent): Prefect's default cache
    # key (inputs and code) would be the same for every node made here
    cached = (dict(persist_result=True, result_serializer="json", cache_key_fn=output_cache_key(step.output))
              if step.output is not None else dict(cache_policy=NO_CACHE))
    # named by iteration: a flow run of several iterations holds several runs of each node
    return task(run, name=step.name, task_run_name=f"{step.name}-{{k}}", retries=step.retries,
                retry_delay_seconds=step.retry_delay_seconds, retry_condition_fn=retry_while_running, **cached)


NODES = {step.name: _node_task(step) for step in STEPS}


def call_node(step: Step, run: dict, k: int, inputs: tuple) -> Any:
    """Run node `step` of iteration k of the run whose context is `run` in the current flow run, `inputs` the
    outputs of the steps it names; its output (its error is raised)."""
    return NODES[step.name](quote(run), quote(k), *(opaque(value) for value in inputs))
