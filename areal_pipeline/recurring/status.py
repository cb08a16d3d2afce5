"""A line's state for people and programs: `areal-pipeline recurring status [--json]`, and the rows of the line's
table artifact. Read from the ledger alone (no lock: the ledger is replaced whole, so a reader sees one version)."""

from __future__ import annotations

from typing import Any, Optional

from areal_pipeline.recurring.ledger import Ledger


def _gate(gate: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    if not gate:
        return None
    return {"test": gate["test"], "prompts": gate["prompts"], "champion": gate["champion"],
            "candidate": gate["candidate"], "improvement": gate["improvement"], "p_value": gate["p_value"],
            "passed": gate["passed"]}


def line_status(ledger: Ledger, busy: bool = False) -> dict[str, Any]:
    """One object: the line, its champion (run_id, checkpoint, gate figures; null run_id: the base model), what its
    servers serve, and every firing oldest first. `busy`: whether a process holds the line's lock now; an
    unfinished firing without one was killed, and reads as failed (state "killed") until it is resumed."""
    champion = ledger.champion

    def state(f: dict[str, Any]) -> tuple[Optional[str], str]:
        if f["state"] == "running" and not busy:
            return "failed", "killed"
        return f["decision"], f["state"]
    return {
        "line": ledger.name,
        "champion": ({"run_id": champion["run_id"], "iteration": champion["iteration"],
                      "checkpoint": champion["checkpoint"], "gate": _gate(champion.get("gate")),
                      "firing": champion.get("firing")} if champion
                     else {"run_id": None, "iteration": 0, "checkpoint": ledger.data["base_model"], "gate": None,
                           "firing": None}),
        "served": ledger.data.get("served"),
        "firings": [{"id": f["id"], "run_id": f["run_id"], "decision": state(f)[0], "state": state(f)[1],
                     "rows": f["rows"], "replay_rows": f["replay_rows"], "files": f["files"],
                     "traffic": f.get("traffic"),
                     "gate": _gate(f["gate"]), "approved_by": f["approved_by"], "reason": f["reason"],
                     "error": f["error"], "started_at": f["started_at"], "ended_at": f["ended_at"],
                     "flow_runs": f["flow_runs"], "from": f["from"]} for f in ledger.firings],
    }


def line_rows(ledger: Ledger) -> list[dict[str, Any]]:
    """The line's table: one row per firing."""
    rows = []
    for f in ledger.firings:
        gate = f["gate"] or {}
        rows.append({"firing": f["id"], "decision": f["decision"] or f["state"], "run_id": f["run_id"],
                     "rows": f["rows"], "traffic_samples": (f.get("traffic") or {}).get("trained"),
                     "champion_reward": _round((gate.get("champion") or {}).get("mean_reward")),
                     "candidate_reward": _round((gate.get("candidate") or {}).get("mean_reward")),
                     "improvement": _round(gate.get("improvement")), "p_value": _round(gate.get("p_value")),
                     "approved_by": f["approved_by"], "reason": f["reason"] or f["error"], "ended": f["ended_at"]})
    return rows


def _traffic_text(traffic: Optional[dict[str, Any]]) -> str:
    if not traffic:
        return ""
    return (f", {traffic['trained']} traffic samples (waiting {traffic['waiting']}, expired {traffic['expired']}, "
            f"stale {traffic['stale']})")


def _round(value: Any) -> Any:
    return round(value, 4) if isinstance(value, float) else value


def status_text(status: dict[str, Any]) -> str:
    """`recurring status` for a terminal."""
    champion = status["champion"]
    lines = [f"line {status['line']}: champion "
             + (f"{champion['run_id']} (iteration {champion['iteration']}, firing {champion['firing']})"
                if champion["run_id"] else "the base model") + f"\n  checkpoint: {champion['checkpoint']}"]
    served = status.get("served")
    if served:
        lines.append(f"  served on {', '.join(served['addresses'])} as version {served['version']}")
    if not status["firings"]:
        lines.append("no firing yet")
    for f in status["firings"]:
        gate = f["gate"]
        figures = (f"; gate {gate['test']}: champion {gate['champion']['mean_reward']:.3f} -> candidate "
                   f"{gate['candidate']['mean_reward']:.3f} ({gate['improvement']:+.3f}, p={gate['p_value']:.3g})"
                   if gate else "")
        who = f"; approved by {f['approved_by']}" if f["approved_by"] and f["decision"] == "promoted" else ""
        why = f": {f['reason'] or f['error']}" if (f["reason"] or f["error"]) and f["decision"] != "promoted" else ""
        lines.append(f"  firing {f['id']}: {f['decision'] or f['state']}{why} - {f['run_id'] or '(no candidate)'}, "
                     f"{f['rows']} rows{_traffic_text(f.get('traffic'))}{figures}{who}")
    return "\n".join(lines)
