"""Prefect events of a training run, for automations (`areal-pipeline guard`, or the user's own) and the Events page.

    areal.run.started            when the train flow starts its iterations (payload: first, last, config)
    areal.iteration.completed    after each iteration (payload: its metrics record: reward mean, eval pass@1, KL,
                                 entropy, staleness, clip fraction, the time of each node, ...)
    areal.run.finished           after the last iteration (payload: the run's summary)
    areal.run.failed             when the iterations end in an error, a stop signal or a cancellation (payload:
                                 the error, and whether Prefect cancelled the run)

Every event's resource is the run, `areal.run.<run_id>`; its related resources start with the train flow run
(role `flow-run`), so a Prefect action with an inferred flow run (cancel, pause) acts on the train run, not on
the iteration's child run. Prefect's trigger matching compares label values as text (exact, prefix with `*`, or
negated), never as numbers; so the iteration event's resource also carries the figures a guard watches as
*levels*: fixed-width text whose text order is the numeric order (`level`), and "value >= x" becomes a finite
list of prefixes (`at_least_patterns`) that a trigger's `match` can hold.

    areal.reward-drop    how far the reward's moving average (REWARD_WINDOW iterations) is below its best so far
    areal.kl             KL to the reference policy (batch mean; 0 unless ppo.kl_ctl > 0 computes it)
    areal.approx-kl      the update's approximate KL between the behaviour and the new policy

Sending an event queues it for Prefect's events worker (a background thread and one websocket): nothing waits
on the API in the iteration's path.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from decimal import ROUND_FLOOR, Decimal
from typing import Any, Iterator, Optional

from areal_pipeline.utils import get_logger

logger = get_logger(__name__)

ITERATION_COMPLETED = "areal.iteration.completed"
RUN_STARTED, RUN_FINISHED, RUN_FAILED = "areal.run.started", "areal.run.finished", "areal.run.failed"
RESOURCE_PREFIX = "areal.run."
REWARD_WINDOW = 3

# Levels: 4 integer digits, 6 decimals. Larger values, inf and NaN (a diverged update) read as the top level.
_QUANTUM = Decimal("0.000001")
_TOP = Decimal("9999.999999")
TOP_LEVEL = f"{_TOP:011.6f}"
NO_LEVEL = "none"  # a figure the iteration did not measure: matches no prefix pattern


def level(value: Optional[float]) -> str:
    """`value` as a label whose text order is its numeric order: '0000.300000' for 0.3 (rounded down to 1e-6,
    negatives as 0, above 9999.999999 and non-finite values as the top level)."""
    if value is None:
        return NO_LEVEL
    if not math.isfinite(value):
        return TOP_LEVEL
    quantized = min(max(Decimal(repr(float(value))), Decimal(0)), _TOP).quantize(_QUANTUM, rounding=ROUND_FLOOR)
    return f"{quantized:011.6f}"


def at_least_patterns(threshold: float) -> list[str]:
    """Prefix patterns (Prefect's `value*`) that together match exactly the levels >= level(threshold): at each
    digit of the threshold's level, every larger digit after the same prefix; then the threshold's own
    significant digits followed by anything."""
    check_threshold(threshold)
    text = level(threshold)
    significant = [i for i, c in enumerate(text) if c not in "0."]
    if not significant:  # >= 0: every level
        return [f"{d}*" for d in range(10)]
    last = significant[-1]
    patterns = [text[:i] + f"{d}*" for i in range(last + 1) if text[i] != "."
                for d in range(int(text[i]) + 1, 10)]
    return patterns + [text[: last + 1] + "*"]


def above_patterns(threshold: float) -> list[str]:
    """Prefix patterns matching the levels > level(threshold)."""
    check_threshold(threshold)
    if level(threshold) == TOP_LEVEL:
        raise ValueError(f"threshold {threshold}: nothing is above the top level {TOP_LEVEL}")
    return at_least_patterns(float(Decimal(level(threshold)) + _QUANTUM))


def check_threshold(threshold: float) -> None:
    if not isinstance(threshold, (int, float)) or not math.isfinite(threshold) or not 0 <= threshold <= float(_TOP):
        raise ValueError(f"threshold {threshold!r}: must be a number in [0, {_TOP}]")


def run_resource(run_id: str, **labels: str) -> dict[str, str]:
    return {"prefect.resource.id": f"{RESOURCE_PREFIX}{run_id}", "prefect.resource.name": run_id, **labels}


class RunEvents:
    """The events of one train flow run of run `run_id` (see the module docstring)."""

    def __init__(self, run_id: str, flow_run_id: Optional[str], history: list[dict[str, Any]]):
        self.run_id = run_id
        self.related = ([{"prefect.resource.id": f"prefect.flow-run.{flow_run_id}",
                          "prefect.resource.role": "flow-run"}] if flow_run_id else [])
        self._window: deque[float] = deque(maxlen=REWARD_WINDOW)
        self.best_average: Optional[float] = None
        for record in history:  # earlier iterations of the same run id (a resumed or continued run)
            self._reward_drop(record.get("reward_mean"))

    def _reward_drop(self, reward: Optional[float]) -> Optional[float]:
        if reward is None or not math.isfinite(reward):
            return None
        self._window.append(reward)
        average = sum(self._window) / len(self._window)
        self.best_average = average if self.best_average is None else max(self.best_average, average)
        return self.best_average - average

    def _emit(self, event: str, payload: dict[str, Any], **labels: str) -> None:
        from prefect.events import emit_event

        try:
            emit_event(event=event, resource=run_resource(self.run_id, **labels), related=self.related,
                       payload=payload)
        except Exception:  # an event that cannot be sent is worth a warning, never the run
            logger.warning("could not emit %s for run %s", event, self.run_id, exc_info=True)

    def started(self, first: int, last: int, config: dict[str, Any]) -> None:
        self._emit(RUN_STARTED, {"first_iteration": first, "last_iteration": last, "config": config})
        _notify(self.run_id, "started", first, last)

    def iteration_completed(self, k: int, record: dict[str, Any]) -> dict[str, str]:
        """Emit iteration k's event; returns the levels it carries."""
        drop = self._reward_drop(record.get("reward_mean"))
        levels = {"areal.iteration": str(k), "areal.reward-drop": level(drop), "areal.kl": level(record.get("kl")),
                  "areal.approx-kl": level(record.get("approx_kl"))}
        payload = {**_finite(record), "reward_drop": drop, "reward_window": REWARD_WINDOW}
        self._emit(ITERATION_COMPLETED, payload, **levels)
        _notify(self.run_id, "iteration", k, record)
        return levels

    def finished(self, summary: dict[str, Any]) -> None:
        self._emit(RUN_FINISHED, _finite(summary))
        _notify(self.run_id, "finished")

    def failed(self, error: BaseException, cancelled: bool) -> None:
        self._emit(RUN_FAILED, {"error": f"{type(error).__name__}: {error}", "cancelled": cancelled})
        _notify(self.run_id, "failed")


def _finite(record: dict[str, Any]) -> dict[str, Any]:
    """JSON has no NaN or inf: a diverged figure is sent as a string."""
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


# In-process listeners of the same events (the command line's progress line): objects with a `run_id` and the
# methods started(first, last), iteration(k, record), finished(), failed().
_LISTENERS: list[Any] = []


@contextlib.contextmanager
def listening(listener: Optional[Any]) -> Iterator[None]:
    if listener is None:
        yield
        return
    _LISTENERS.append(listener)
    try:
        yield
    finally:
        _LISTENERS.remove(listener)


def _notify(run_id: str, method: str, *args: Any) -> None:
    for listener in [item for item in _LISTENERS if item.run_id == run_id]:
        try:
            getattr(listener, method)(*args)
        except Exception:  # what a display cannot show is no reason to fail a run
            logger.warning("listener %r could not take %s", listener, method, exc_info=True)
