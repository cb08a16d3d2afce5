"""Deterministic errors fail at once; transient faults are retried (errors.is_transient, and the nodes' retry
condition on Prefect's real engine)."""

from __future__ import annotations

import subprocess
import urllib.error
from collections import Counter
from types import SimpleNamespace

import pytest
from prefect import flow, task

from areal_pipeline.config import ConfigError
from areal_pipeline.data.datasets import DatasetError
from areal_pipeline.data.shards import ShardError
from areal_pipeline.errors import PermanentError, is_transient
from areal_pipeline.inference.client import InferenceServerError
from areal_pipeline.training.client import TrainerError
from areal_pipeline.utils import DeadlineExceeded
from tasks import runs
from tasks.nodes import retry_while_running


def _caused(error: Exception, cause: BaseException) -> Exception:
    error.__cause__ = cause
    return error


PERMANENT = {
    "config": ConfigError("rollout.batch_size=0: must be >= 1"),
    "dataset row": DatasetError("train.jsonl, line 3: invalid JSON"),
    "shards": ShardError("iter_1/rollout: no manifest.json"),
    "value": ValueError("bad"),
    "type": TypeError("bad"),
    "key": KeyError("prompt_id"),
    "index": IndexError("list index out of range"),
    "missing file": FileNotFoundError("no such file"),
    "a file in the way": NotADirectoryError("iter_2 is a file"),
    "trainer bad request": TrainerError("trainer: bad arguments for 'train'", "error", 400),
    "trainer no checkpoint": TrainerError("trainer: no checkpoint at x", "no_checkpoint", 404),
    "server bad request": InferenceServerError("127.0.0.1:1", "/generate", "HTTP 400: prompt too long", 400),
    "urllib 404": urllib.error.HTTPError("http://x", 404, "Not Found", {}, None),
    "wrapped value error": _caused(RuntimeError("in-process retrieval failed"), ValueError("bad query")),
    "group with a bad value": ExceptionGroup("episodes", [ConnectionResetError(), ValueError("bad")]),
    "interrupt": KeyboardInterrupt(),
}
TRANSIENT = {
    "connection refused": ConnectionRefusedError("refused"),
    "timeout": TimeoutError("timed out"),
    "deadline": DeadlineExceeded("rollout of iteration 3 ran past its 600 s limit"),
    "trainer unreachable": TrainerError("trainer unreachable during train", "unreachable", 0),
    "trainer internal": TrainerError("trainer: RuntimeError: NCCL timeout", "internal", 500),
    "trainer at another version": TrainerError("trainer at version 1", "version_mismatch", 409),
    "server 503": InferenceServerError("127.0.0.1:1", "/generate", "HTTP 503: overloaded", 503),
    "server gave up": InferenceServerError("127.0.0.1:1", "/generate", "failed after 4 attempts"),
    "urllib 503": urllib.error.HTTPError("http://x", 503, "Service Unavailable", {}, None),
    "process died": subprocess.CalledProcessError(-9, ["torchrun"]),
    "unknown runtime error": RuntimeError("reward workers died"),
    "wrapped connection error": _caused(RuntimeError("retrieval failed"), ConnectionResetError()),
    "group of timeouts": ExceptionGroup("episodes", [TimeoutError(), ConnectionResetError()]),
}


@pytest.mark.parametrize("error", PERMANENT.values(), ids=PERMANENT.keys())
def test_deterministic_errors_are_permanent(error):
    assert not is_transient(error)


@pytest.mark.parametrize("error", TRANSIENT.values(), ids=TRANSIENT.keys())
def test_faults_that_may_pass_are_transient(error):
    assert is_transient(error)


def test_library_errors_of_bad_inputs_derive_from_permanent_error():
    assert issubclass(ConfigError, PermanentError) and issubclass(DatasetError, PermanentError)
    assert issubclass(ConfigError, ValueError)  # callers that catch ValueError still do


# ---------------------------------------------------------------------------------------------- on Prefect

FAILURES = {"bad config": PERMANENT["config"], "bad row": PERMANENT["dataset row"],
            "connection refused": TRANSIENT["connection refused"], "server 503": TRANSIENT["server 503"]}
attempts: Counter = Counter()


@task(retries=2, retry_delay_seconds=0, retry_condition_fn=retry_while_running)
def failing_node(run_id: str, failure: str) -> None:
    attempts[run_id] += 1
    raise FAILURES[failure]


@flow
def one_node_flow(run_id: str, failure: str) -> None:
    failing_node(run_id, failure)


def _run_with_live_pipeline(run_id: str, failure: str, services_stopped: bool = False) -> BaseException:
    """Run the flow while `run_id` has a live pipeline (the retry condition asks for it); its failure."""
    runs.register(SimpleNamespace(cfg=SimpleNamespace(run_id=run_id, rollout=SimpleNamespace(group_reward="")),
                                      services=SimpleNamespace(stopped=services_stopped)))
    try:
        with pytest.raises(type(FAILURES[failure])) as raised:
            one_node_flow(run_id, failure)
    finally:
        runs.unregister(run_id)
    return raised.value


@pytest.mark.parametrize("failure, expected_attempts", [("bad config", 1), ("bad row", 1),
                                                        ("connection refused", 3), ("server 503", 3)])
def test_a_node_retries_transient_faults_only(prefect_api, failure, expected_attempts):
    run_id = f"errors-{failure.replace(' ', '-')}"
    error = _run_with_live_pipeline(run_id, failure)
    assert attempts[run_id] == expected_attempts
    assert str(error) == str(FAILURES[failure])  # the node's own error reaches the caller, unwrapped


def test_nothing_is_retried_once_the_services_stopped(prefect_api):
    _run_with_live_pipeline("errors-stopped", "connection refused", services_stopped=True)
    assert attempts["errors-stopped"] == 1
