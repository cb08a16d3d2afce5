"""The nodes of a recurring line's firing (flows/recurring.py), one thin task each over areal_pipeline/recurring/.
Each is idempotent through its output on disk (the firing's directory, the line's champions), so a resumed firing
(a Retry, the same command again) hands back what a killed one finished: no cache policy, files decide."""

from __future__ import annotations

from typing import Any, Optional

from prefect import task
from prefect.cache_policies import NO_CACHE

from areal_pipeline.recurring.gate_eval import run_gate
from areal_pipeline.recurring.ledger import Ledger
from areal_pipeline.recurring.line import Line
from areal_pipeline.recurring.publish import publish

NODE = dict(cache_policy=NO_CACHE)


@task(name="collect_data", **NODE)
def collect_data(line: Line, ledger: Ledger, firing: dict[str, Any]) -> dict[str, Any]:
    return line.collect(ledger, firing)


@task(name="gate", **NODE)
def gate(line: Line, firing: dict[str, Any], data: dict[str, Any], champion: tuple[str, int],
         candidate: tuple[str, int]) -> dict[str, Any]:
    return run_gate(line.cfg, line.firing_dir(firing["id"]) / "gate.json", data["path"], champion, candidate,
                    seed=line.cfg.seed * 1000003 + firing["id"])


@task(name="enshrine", **NODE)
def enshrine(line: Line, firing: dict[str, Any], run_id: str, iteration: int, gate: dict[str, Any]) -> dict[str, Any]:
    return line.enshrine(firing, run_id, iteration, gate)


def _transient_publish_failure(task, task_run, state) -> bool:
    """A server that did not answer for a moment is asked again; a probe that found other weights fails at once."""
    from areal_pipeline.errors import is_transient
    from areal_pipeline.inference.weight_check import WeightMismatchError

    error = state.data
    while isinstance(error, BaseException):
        if isinstance(error, WeightMismatchError):
            return False
        error = error.__cause__
    return isinstance(state.data, BaseException) and is_transient(state.data)


@task(name="publish", retries=2, retry_delay_seconds=5, retry_condition_fn=_transient_publish_failure, **NODE)
def publish_champion(line: Line, model_dir: str, version: int, probe: Optional[list[float]],
                     previous: Optional[tuple[str, int]]) -> dict[str, Any]:
    return publish(line.cfg, line.served_addresses(), model_dir, version, probe, previous)
