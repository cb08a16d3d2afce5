"""`areal-pipeline guard`: Prefect automations that stop a training run when its reward collapses or its KL spikes.

Each guard is one automation on the Prefect server (`PREFECT_API_URL`: a server the user runs, with Prefect's
default services; a run's temporary API server evaluates no automations). Its trigger is the run's
`areal.iteration.completed` event (flows/events.py) whose level label is at or above the threshold, written as
the finite list of prefix patterns that Prefect's text matching can hold; its actions cancel or pause the train
flow run that emitted the event (inferred from the event's related flow run) and, with `--notify`, send the
numbers through a notification block. Automations outlive runs: a guard set before a run starts watches it from
its first iteration, and `--remove` deletes the run's guards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from flows import events

NAME_PREFIX = "areal-guard"
KL_METRICS = {"kl": "areal.kl", "approx_kl": "areal.approx-kl"}
ACTIONS = ("cancel", "pause")


class GuardError(ValueError):
    pass


@dataclass(frozen=True)
class Guard:
    name: str
    label: str
    patterns: list[str]
    condition: str  # for people: what trips it


def automation_name(run_id: str, what: str) -> str:
    return f"{NAME_PREFIX}/{run_id}/{what}"


def plan_guards(run_id: str, reward_drop: Optional[float] = None, kl_above: Optional[float] = None,
                kl_metric: str = "kl") -> list[Guard]:
    """The guards asked for, their thresholds checked (a clear error for a bad one)."""
    if not run_id or any(c.isspace() for c in run_id):
        raise GuardError(f"run id {run_id!r}: must be non-empty, without spaces")
    if kl_metric not in KL_METRICS:
        raise GuardError(f"--kl-metric {kl_metric!r}: choose one of {', '.join(KL_METRICS)}")
    guards = []
    if reward_drop is not None:
        if not math.isfinite(reward_drop) or reward_drop <= 0:
            raise GuardError(f"--reward-drop {reward_drop}: must be a number > 0 (a drop in reward units)")
        guards.append(Guard(automation_name(run_id, "reward-drop"), "areal.reward-drop",
                            _patterns(events.at_least_patterns, reward_drop, "--reward-drop"),
                            f"the reward's {events.REWARD_WINDOW}-iteration average falls {reward_drop:g} or more "
                            "below its best"))
    if kl_above is not None:
        guards.append(Guard(automation_name(run_id, kl_metric.replace("_", "-")), KL_METRICS[kl_metric],
                            _patterns(events.above_patterns, kl_above, "--kl-above"),
                            f"{kl_metric} rises above {kl_above:g}"))
    if not guards:
        raise GuardError("nothing to guard: give --reward-drop and/or --kl-above")
    return guards


def _patterns(make, threshold: float, option: str) -> list[str]:
    try:
        return make(threshold)
    except ValueError as error:
        raise GuardError(f"{option}: {error}") from None


def _notification_body(guard: Guard) -> str:
    # Jinja, rendered by the server with the triggering event
    return ("Run {{ event.resource.name }}, iteration {{ event.resource['areal.iteration'] }}: "
            f"{guard.condition}.\n"
            "reward_mean {{ event.payload.reward_mean }}, reward_drop {{ event.payload.reward_drop }}, "
            "kl {{ event.payload.kl }}, approx_kl {{ event.payload.approx_kl }}, "
            "eval_pass_at_1 {{ event.payload.eval_pass_at_1 }}.\n"
            "Flow run: {{ event.related[0].id }}")


def _automation(run_id: str, guard: Guard, action: str, notify_block_id=None):
    from datetime import timedelta

    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import CancelFlowRun, ChangeFlowRunState, SendNotification
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    reason = f"{guard.name}: {guard.condition}"
    stop = (CancelFlowRun() if action == "cancel" else
            ChangeFlowRunState(state=StateType.PAUSED, name="Paused", message=reason))
    actions = [stop]
    if notify_block_id is not None:
        actions.append(SendNotification(block_document_id=notify_block_id, subject=f"[areal-pipeline] {reason}",
                                        body=_notification_body(guard)))
    trigger = EventTrigger(expect={events.ITERATION_COMPLETED},
                           match={"prefect.resource.id": f"{events.RESOURCE_PREFIX}{run_id}",
                                  guard.label: guard.patterns},
                           posture=Posture.Reactive, threshold=1, within=timedelta(0))
    return AutomationCore(name=guard.name, description=f"{action} the train flow run of {run_id} when {guard.condition}"
                          f" (label {guard.label} at or above the threshold's level)", enabled=True,
                          trigger=trigger, actions=actions)


async def _notify_block_id(client, block: str):
    from prefect.exceptions import ObjectNotFound

    slug, _, name = block.partition("/")
    if not slug or not name:
        raise GuardError(f"--notify {block!r}: give a notification block as BLOCK_TYPE/NAME, e.g. slack-webhook/alerts")
    try:
        return (await client.read_block_document_by_name(name, block_type_slug=slug)).id
    except ObjectNotFound:
        raise GuardError(f"--notify {block!r}: no such block on the Prefect server (create it in the UI's Blocks "
                         "page or with its Python class's .save())") from None


async def remove_guards(run_id: str) -> list[str]:
    """Delete the run's guard automations; their names."""
    from prefect.client.orchestration import get_client

    removed = []
    async with get_client() as client:
        for automation in await client.read_automations():
            if automation.name.startswith(f"{NAME_PREFIX}/{run_id}/"):
                await client.delete_automation(automation.id)
                removed.append(automation.name)
    return removed


async def create_guards(run_id: str, reward_drop: Optional[float] = None, kl_above: Optional[float] = None,
                        kl_metric: str = "kl", action: str = "cancel", notify: Optional[str] = None) -> list[dict]:
    """Create (or replace) the run's guard automations on the configured Prefect server; one record each."""
    from prefect.client.orchestration import get_client

    if action not in ACTIONS:
        raise GuardError(f"--action {action!r}: choose one of {', '.join(ACTIONS)}")
    guards = plan_guards(run_id, reward_drop, kl_above, kl_metric)
    async with get_client() as client:
        notify_id = await _notify_block_id(client, notify) if notify else None
        created = []
        for guard in guards:
            for old in await client.read_automations_by_name(guard.name):  # a guard set again replaces itself
                await client.delete_automation(old.id)
            automation_id = await client.create_automation(_automation(run_id, guard, action, notify_id))
            created.append({"name": guard.name, "id": str(automation_id), "action": action,
                            "condition": guard.condition, "label": guard.label, "notify": notify})
    return created


def require_server() -> str:
    """The Prefect API the guard talks to: a server the user runs."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise GuardError("no Prefect server configured: set PREFECT_API_URL to the server your runs report to "
                         "(`prefect server start`); a run's temporary API server evaluates no automations")
    return url
