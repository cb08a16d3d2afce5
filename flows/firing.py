"""A firing's steps, in order (the `recurring` flow's body, flows/recurring.py): each one's output is on disk or in
the line's ledger before the next starts, so a resumed firing goes on from the step that did not finish."""

from __future__ import annotations

from typing import Any, Optional

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.input import RunInput
from pydantic import Field

import tasks.recurring as nodes
from areal_pipeline.recurring.ledger import Ledger, now
from areal_pipeline.recurring.line import Line, gate_summary
from areal_pipeline.run_dir import read_json, write_json
from flows import line_report

APPROVAL_POLL_S = 2  # how often a paused approval asks the API whether it was answered


def this_flow_run() -> Optional[str]:
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    return str(context.flow_run.id) if context else None


def summary(line: Line, firing: dict[str, Any]) -> dict[str, Any]:
    """What a firing's flow run returns (and `recurring fire` prints)."""
    return {"line": line.name, "firing": firing["id"], "decision": firing["decision"], "run_id": firing["run_id"],
            "rows": firing["rows"], "replay_rows": firing["replay_rows"], "gate": firing["gate"],
            "approved_by": firing["approved_by"], "reason": firing["reason"], "traffic": firing.get("traffic")}


def fire(line: Line, ledger: Ledger, firing: dict[str, Any]) -> dict[str, Any]:
    logger = get_run_logger()
    data = nodes.collect_data(line, ledger, firing)
    firing.update(rows=data["rows"], replay_rows=data["replay_rows"], files=[f["name"] for f in data["files"]])
    if "traffic" in data:
        firing["traffic"] = data["traffic"]
    ledger.save()
    if not data["iterations"]:
        why = "no new data" + (f" (the new files' {data['gate_overlap']} rows are all gate prompts)"
                               if data["gate_overlap"] else "")
        if "traffic" in data:
            why += f"; traffic: {data['traffic']['waiting']} sample(s) await their reward"
        ledger.consume(firing, data["files"])
        ledger.end_firing(firing, "no_data", reason=why)
        ledger.save()
        logger.info("line %s, firing %d: %s; nothing trained", line.name, firing["id"], why)
        return summary(line, firing)
    logger.info("line %s, firing %d: %d new rows from %s (+%d replayed)%s; candidate trains %d iterations",
                line.name, firing["id"], data["rows"], ", ".join(firing["files"]) or "no file", data["replay_rows"],
                f", {data['traffic']['trained']} rewarded traffic samples" if "traffic" in data else "",
                data["iterations"])
    cfg = line.candidate_config(ledger, firing, data)
    firing["run_id"] = cfg.run_id
    ledger.save()
    candidate_model = train_candidate(line, ledger, firing, cfg)
    champion = line.champion_model(ledger)
    gate = nodes.gate(line, firing, data, champion, (candidate_model, cfg.total_iterations))
    firing["gate"] = gate_summary(gate)
    if ledger.champion is None and "base_probe" not in ledger.data:
        ledger.data["base_probe"] = gate["probe"]["champion"]  # what a rollback to the base model checks
    ledger.save()
    line_report.publish_gate(line, firing, gate)
    answer = approve(line, firing, gate)
    firing.update(approved_by=answer["by"], reason=answer["reason"])
    if not answer["approved"]:
        ledger.consume(firing, data["files"])
        ledger.end_firing(firing, "rejected")
        ledger.save()
        line_report.emit(line, "rejected", {"firing": firing["id"], "run_id": cfg.run_id, "reason": answer["reason"],
                                            "gate": firing["gate"]})
        logger.info("line %s, firing %d: candidate %s rejected: %s", line.name, firing["id"], cfg.run_id,
                    answer["reason"])
        return summary(line, firing)
    crowned = nodes.enshrine(line, firing, cfg.run_id, cfg.total_iterations, gate)
    served = nodes.publish_champion(line, crowned["model"], crowned["iteration"], crowned["probe"],
                                    previous=served_before(ledger, champion))
    promote(line, ledger, firing, crowned, served, data["files"])
    logger.info("line %s, firing %d: %s is the champion (%s)", line.name, firing["id"], cfg.run_id, answer["reason"])
    return summary(line, firing)


def served_before(ledger: Ledger, champion: tuple[str, int]) -> tuple[str, int]:
    """What the line's servers serve now, to give them back where a publication fails."""
    served = ledger.data.get("served")
    return (served["model"], int(served["version"])) if served else champion


def train_candidate(line: Line, ledger: Ledger, firing: dict[str, Any], cfg) -> str:
    """The candidate's run, trained to its last iteration (a child `train` flow run; a resumed firing's run goes on
    from its last finished node): a branch of the champion's run at the champion's iteration, or, while the
    champion is the base model, a new run of it. Returns its final checkpoint's model directory."""
    from flows.train import train

    champion = ledger.champion
    if champion is None:
        config_path = line.save_candidate_config(firing, cfg)
    else:
        from areal_pipeline.branching import BranchError, plan_branch_of
        from flows.branch import reference_parent, restore_parent_policy_task

        parent = line.run_dir(champion["run_id"])
        if not (parent / "config.yaml").is_file():
            raise BranchError(f"the champion's run directory {parent} is gone: the candidate branches from it (its "
                              f"config and iterations); the champion's checkpoint is kept at {champion['checkpoint']}")
        plan = plan_branch_of(parent, int(champion["iteration"]), cfg, overrides=firing.get("overrides", []))
        if reference_parent(plan)["needs_restore"]:
            restore_parent_policy_task(plan)
        config_path = plan.run_dir / "config.yaml"
    line.place_traffic(firing, cfg)
    train(config_path=str(config_path), run_id=cfg.run_id)
    return line.candidate_model(firing, cfg)


class Approval(RunInput):
    """A person's answer to a candidate that passed the gate."""

    approve: bool = Field(default=False, description="Promote this candidate: it becomes the line's champion and "
                                                     "the servers the line serves load it")
    reason: str = Field(default="", description="Why (kept in the line's ledger)")
    approver: str = Field(default="", description="Who answers (kept in the line's ledger)")


def approve(line: Line, firing: dict[str, Any], gate: dict[str, Any]) -> dict[str, Any]:
    """The decision, recorded once in the firing's approval.json: the gate's where it failed or approval is
    automatic; else a person's, asked on the form of a child flow run that pauses up to approval_timeout (no
    answer by then rejects)."""
    path = line.firing_dir(firing["id"]) / "approval.json"
    answer = read_json(path)
    if answer is not None:
        return answer
    if not gate["passed"]:
        answer = {"approved": False, "by": "gate", "reason": gate["reason"]}
    elif line.cfg.recurring.approval == "auto":
        answer = {"approved": True, "by": "auto", "reason": gate["reason"]}
    else:
        timeout = line.cfg.recurring.approval_timeout
        state = approval(line.name, firing["id"], line_report.approval_form(line, firing, gate), timeout,
                         str(line.firing_dir(firing["id"]) / "approval-request.json"), return_state=True)
        if state.is_completed():
            answer = state.result()
        elif state.is_failed() and _pause_timed_out(state):
            answer = {"approved": False, "by": "timeout", "reason": f"no answer within {timeout:.0f} s"}
        else:
            state.result()  # raises its error: the firing fails and is resumed later, asking again
    return write_json(path, answer)


def _pause_timed_out(state) -> bool:
    """Whether the approval run failed because its pause ran out (Prefect's FlowPauseTimeout, or the API's own
    refusal to resume a pause past its timeout)."""
    from prefect.exceptions import FlowPauseTimeout

    error = state.result(raise_on_failure=False)
    return isinstance(error, FlowPauseTimeout) or "never resumed" in f"{state.message} {error}"


@flow(name="approval", flow_run_name="{line}/firing-{firing_id}/approval", persist_result=True,
      result_serializer="json")
def approval(line: str, firing_id: int, form: str, timeout_s: float, request_path: str) -> dict[str, Any]:
    """A paused run whose form (Resume in the UI) takes a person's answer to firing `firing_id`'s candidate.

    Args:
        line: The line's name.
        firing_id: The firing whose candidate is to be approved or rejected.
        form: What the form shows: the gate's figures and both policies' answers.
        timeout_s: Seconds to wait for an answer; none by then rejects the candidate.
        request_path: Where the waiting request is recorded (for `areal-pipeline recurring approve`).
    """
    from prefect.flow_runs import pause_flow_run

    write_json(request_path, {"flow_run_id": this_flow_run(), "line": line, "firing": firing_id})
    answer = pause_flow_run(wait_for_input=Approval.with_initial_data(description=form), timeout=int(timeout_s),
                            poll_interval=APPROVAL_POLL_S)
    return {"approved": bool(answer.approve), "by": answer.approver.strip() or "(unnamed)",
            "reason": answer.reason.strip() or ("approved" if answer.approve else "rejected")}


@task(name="promote", cache_policy=NO_CACHE)
def promote(line: Line, ledger: Ledger, firing: dict[str, Any], champion: dict[str, Any], served: dict[str, Any],
            files: list[dict[str, Any]]) -> dict[str, Any]:
    """The ledger names the new champion (one write: champion, watermark, what the servers serve, the firing's
    end), then the event areal.line.promoted."""
    ledger.consume(firing, files)
    ledger.crown(champion)
    if served["addresses"]:
        ledger.record_served({**served, "at": now()})
    ledger.end_firing(firing, "promoted")
    ledger.save()
    line_report.emit(line, "promoted", {"firing": firing["id"], "run_id": champion["run_id"],
                                        "iteration": champion["iteration"], "checkpoint": champion["checkpoint"],
                                        "gate": champion["gate"], "served": served["addresses"]})
    return champion
