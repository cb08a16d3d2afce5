"""The `recurring` flow: one firing of a recurring line (areal_pipeline/recurring/, docs/recurring.md), its steps
task runs and child flow runs of its flow run `<line>/firing-<n>`:

    collect_data    the rows new since the line's last firing ("no new data": it ends there, Completed)
    [reference_parent, restore_parent_policy]   the candidate as a branch of the champion's run (not the first)
    train           the candidate's run (`<line>-<n>`), a child flow run: recurring.iterations iterations
    gate            champion and candidate on the gate's held-out prompts, a paired test: a table artifact
    approval        (recurring.approval=manual, a candidate that passed the gate) a child flow run paused for a
                    person's answer on a form in the UI
    enshrine, publish, promote    the line's copy of the checkpoint; the servers it serves load and verify it;
                    the ledger names the new champion, and the event areal.line.promoted goes out

The line's lock holds one firing at a time: a firing that starts while another runs waits for it (up to
recurring.wait_timeout), then usually finds no new data. A firing that failed or was killed is resumed by the
next one (a Retry of its flow run, the same command, the next scheduled firing), from its last finished step.
"""

from __future__ import annotations

from typing import Any, Optional

from prefect import flow, get_run_logger, runtime

from areal_pipeline.recurring.ledger import Ledger
from areal_pipeline.recurring.line import Line, check_line_config
from flows import labels, line_report, run_logs
from flows.firing import fire, summary, this_flow_run

DEFAULT_CONFIG = "configs/recurring_cpu.yaml"


def load_line(config_path: str, overrides: Optional[list[str]]) -> Line:
    from areal_pipeline.run_spec import load_config

    cfg = load_config(config_path, list(overrides or []))
    check_line_config(cfg)
    return Line(cfg, str(config_path))


def _firing_run_name() -> str:
    from areal_pipeline.config import read_layers
    from areal_pipeline.config.loading import layered_value

    parameters = runtime.flow_run.parameters
    try:
        layers = read_layers(parameters.get("config_path") or DEFAULT_CONFIG, parameters.get("overrides"))
        name = layered_value(layers, "recurring.line", "")[0] or layered_value(layers, "run_id", "tiny-cpu")[0]
    except Exception:  # noqa: BLE001  the body reports a bad config with its reason: naming never raises
        name = "line"
    return f"{name}/firing"


def _label(line: Line, firing: dict[str, Any], what: str = "firing") -> None:
    """Name the flow run after the firing (`<line>/firing-<n>`) and tag it `line:<line>`."""
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    flow_run = FlowRunContext.get().flow_run
    with get_client(sync_client=True) as client:
        client.update_flow_run(flow_run.id, name=f"{line.name}/{what}-{firing['id']}",
                               tags=sorted({*flow_run.tags, f"line:{line.name}", "recurring"}))


def open_firing(line: Line, ledger: Ledger, overrides: list[str]) -> tuple[Line, dict[str, Any]]:
    """The firing this flow run carries on: the line's unfinished one (resumed under its own overrides), else a
    new one. Returns the line as that firing configures it."""
    logger = get_run_logger()
    firing = ledger.open_firing
    if firing is None:
        firing = ledger.start_firing("firing", this_flow_run(), overrides)
    else:
        ledger.resume_firing(firing, this_flow_run())
        if firing.get("overrides", []) != overrides:
            logger.warning("firing %d of line %s is unfinished: resuming it with its own overrides %s (the ones "
                           "given now, %s, apply to a new firing)", firing["id"], line.name,
                           firing.get("overrides", []), overrides)
            line = load_line(line.config_path, firing.get("overrides", []))
        else:
            logger.info("resuming firing %d of line %s", firing["id"], line.name)
    ledger.save()
    return line, firing


@flow(name="recurring", flow_run_name=_firing_run_name, persist_result=True, result_serializer="json")
def recurring(config_path: str = DEFAULT_CONFIG, overrides: Optional[list[str]] = None) -> dict[str, Any]:
    """One firing of a recurring line: train a candidate from the line's champion on the rows that arrived since
    its last firing, gate it against the champion on held-out prompts, have it approved, promote it to the
    servers the line serves (docs/recurring.md).

    Args:
        config_path: The line's config file (its `recurring` section, and `dataset.path`: the directory where
            files of rows arrive), e.g. configs/recurring_cpu.yaml.
        overrides: Dotted key=value overrides of the config for this firing's candidate, e.g.
            trainer.optimizer.lr=5e-4 (an unfinished firing resumes with its own).
    """
    run_logs.keep_completed_task_runs_from_the_api()
    logger = get_run_logger()
    overrides = list(overrides or [])
    line = load_line(config_path, overrides)
    with line.lock(on_wait=lambda holder: logger.info("line %s: waiting for its firing in progress (%s) to end",
                                                      line.name, holder)), \
            labels.crashed_if_forced_to_exit(runtime.flow_run.id):
        ledger = line.ledger()
        line, firing = open_firing(line, ledger, overrides)
        _label(line, firing)
        try:
            return fire(line, ledger, firing)
        except Exception as error:
            ledger.fail_firing(firing, f"{type(error).__name__}: {error}")
            ledger.save()
            raise
        finally:
            line_report.publish_line(line, ledger)


class RollbackError(ValueError):
    pass


def rollback_target(ledger: Ledger, to: Optional[str]) -> Optional[dict[str, Any]]:
    """The champion a rollback publishes: the one before the current champion (by default), the earlier champion
    `to` names (its run id), or the base model (`to` = "base")."""
    current = ledger.champion
    if to == "base":
        if current is None:
            raise RollbackError(f"line {ledger.name}: the champion is the base model already")
        return None
    history = [c for c in ledger.data["champions"] if c.get("run_id")]
    if to is not None:
        target = next((c for c in reversed(history) if c["run_id"] == to), None)
        if target is None:
            names = sorted({c["run_id"] for c in history}) or ["(none)"]
            raise RollbackError(f"line {ledger.name}: {to!r} was never its champion; its champions: "
                                f"{', '.join(names)} (or base)")
        if current is not None and target["run_id"] == current["run_id"]:
            raise RollbackError(f"line {ledger.name}: {to} is the champion already")
        return {k: v for k, v in target.items() if k != "since"}
    earlier = [c for c in ledger.data["champions"][:-1]
               if (c.get("run_id") or None) != (current or {}).get("run_id")]
    if not earlier:
        raise RollbackError(f"line {ledger.name}: no earlier champion to roll back to")
    target = earlier[-1]
    return {k: v for k, v in target.items() if k != "since"} if target.get("run_id") else None


def _rollback_run_name() -> str:
    return _firing_run_name().replace("/firing", "/rollback")


@flow(name="recurring-rollback", flow_run_name=_rollback_run_name, persist_result=True, result_serializer="json")
def recurring_rollback(config_path: str = DEFAULT_CONFIG, overrides: Optional[list[str]] = None,
                       to: Optional[str] = None) -> dict[str, Any]:
    """Publish an earlier champion of a line again: it becomes the champion, the servers the line serves load it
    (verified by the probe), and the ledger records a firing of kind rollback.

    Args:
        config_path: The line's config file.
        overrides: Dotted key=value overrides of it.
        to: The run id of an earlier champion, or "base" (the base model); default: the champion before the
            current one.
    """
    from flows.firing import served_before
    from tasks.recurring import publish_champion

    logger = get_run_logger()
    line = load_line(config_path, overrides)
    with line.lock(on_wait=lambda holder: logger.info("line %s: waiting for %s", line.name, holder)):
        ledger = line.ledger()
        unfinished = ledger.open_firing
        if unfinished is not None:
            raise RollbackError(f"line {line.name}: firing {unfinished['id']} is unfinished ({unfinished['state']}): "
                                "resume it (`areal-pipeline recurring fire`) or end it (`areal-pipeline recurring "
                                "abandon`) first")
        target = rollback_target(ledger, to)
        before = ledger.champion
        firing = ledger.start_firing("rollback", this_flow_run(), list(overrides or []))
        firing["run_id"] = target["run_id"] if target else None
        ledger.save()
        _label(line, firing, "rollback")
        model, version = line.champion_model(ledger, target)
        probe = target.get("probe") if target else ledger.data.get("base_probe")
        try:
            served = publish_champion(line, model, version, probe,
                                      previous=served_before(ledger, line.champion_model(ledger)))
        except Exception as error:
            firing.update(state="ended", decision="failed", error=f"{type(error).__name__}: {error}")
            ledger.save()
            raise
        ledger.crown(target)
        if served["addresses"]:
            ledger.record_served({**served, "at": firing["started_at"]})
        was = f"{before['run_id']} (iteration {before['iteration']})" if before else "the base model"
        now_ = f"{target['run_id']} (iteration {target['iteration']})" if target else "the base model"
        ledger.end_firing(firing, "rollback", reason=f"rolled back from {was} to {now_}", approved_by="rollback")
        ledger.save()
        line_report.emit(line, "rolled-back", {"firing": firing["id"], "run_id": firing["run_id"],
                                               "from": before and before["run_id"], "served": served["addresses"]})
        line_report.publish_line(line, ledger)
        logger.info("line %s: %s", line.name, firing["reason"])
        return summary(line, firing)
