"""What Prefect shows of a recurring line: per firing, the gate's table (both policies' figures, the test, its
p-value, the decision) and the answers side by side; per line, a table of every firing; the approval form's text;
and the line's events,

    areal.line.promoted      a candidate became the champion (payload: line, firing, run_id, iteration,
                             checkpoint, the gate's figures, the servers that load it)
    areal.line.rejected      a candidate was not promoted (the reason: the gate's, a person's, a timeout)
    areal.line.rolled-back   an earlier champion was published again

each on the resource `areal.line.<line>`, related to the firing's flow run."""

from __future__ import annotations

from typing import Any

from areal_pipeline.recurring.ledger import Ledger
from areal_pipeline.recurring.line import Line
from areal_pipeline.recurring.status import line_rows
from areal_pipeline.utils import get_logger
from flows.artifacts import artifact_key

logger = get_logger(__name__)

ANSWER_CHARS = 160


def _figure(value: Any) -> Any:
    return round(value, 4) if isinstance(value, float) else value


def gate_table(gate: dict[str, Any]) -> list[dict[str, Any]]:
    rows = [{"figure": name, "champion": _figure(gate["champion"][key]), "candidate": _figure(gate["candidate"][key])}
            for name, key in (("prompts", "prompts"), ("mean reward", "mean_reward"), ("pass@1", "pass_at_1"))]
    rows += [{"figure": "improvement", "champion": None, "candidate": _figure(gate["improvement"])},
             {"figure": f"{gate['test']} p-value", "champion": None, "candidate": _figure(gate["p_value"])},
             {"figure": "needed", "champion": None,
              "candidate": f"at least {gate['min_improvement']}, p <= {1 - gate['confidence']:.3g}"},
             {"figure": "decision", "champion": None, "candidate": "passed" if gate["passed"] else "failed"}]
    return rows


def answers_markdown(gate: dict[str, Any]) -> str:
    """A few gate prompts with both policies' answers (first those where they differ), as a table."""
    rows = [f"| {_cell(item['prompt'])} | {_cell(item['answer'])} | {_cell(item['champion']['completion'])} "
            f"({item['champion']['reward']:.2f}) | {_cell(item['candidate']['completion'])} "
            f"({item['candidate']['reward']:.2f}) |" for item in gate.get("answers", [])]
    if not rows:
        return "(no answers recorded)"
    return "| prompt | reference | champion (reward) | candidate (reward) |\n|---|---|---|---|\n" + "\n".join(rows)


def _cell(value: Any) -> str:
    text = " ".join(str(value).split())[:ANSWER_CHARS]
    return text.replace("|", "\\|") or " "


def approval_form(line: Line, firing: dict[str, Any], gate: dict[str, Any]) -> str:
    """The markdown above the approval form's fields: the gate's figures and a few answers of both policies."""
    table = "\n".join(f"| {r['figure']} | {'' if r['champion'] is None else r['champion']} | {r['candidate']} |"
                      for r in gate_table(gate))
    return (f"## Line `{line.name}`, firing {firing['id']}: promote `{firing['run_id']}`?\n\n"
            f"It trained on {firing['rows']} new rows ({', '.join(firing['files'])}) from the champion "
            f"{_champion_text(firing)}. The gate: {gate['reason']}.\n\n"
            f"| | champion | candidate |\n|---|---|---|\n{table}\n\n"
            f"### Answers to the same gate prompts\n{answers_markdown(gate)}\n\n"
            "Set **approve** and a **reason**, then submit. No answer within "
            f"{line.cfg.recurring.approval_timeout:.0f} s rejects the candidate.")


def _champion_text(firing: dict[str, Any]) -> str:
    start = firing.get("from")
    return f"`{start['run_id']}` (iteration {start['iteration']})" if start else "(the base model)"


def publish_gate(line: Line, firing: dict[str, Any], gate: dict[str, Any]) -> None:
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    key = artifact_key(line.name, f"firing-{firing['id']:04d}-gate")
    try:
        create_table_artifact(key=key, table=gate_table(gate),
                              description=f"line {line.name}, firing {firing['id']}: {firing['run_id']} against the "
                                          f"champion {_champion_text(firing)}; {gate['reason']}")
        create_markdown_artifact(key=artifact_key(line.name, f"firing-{firing['id']:04d}-answers"),
                                 markdown=f"# Firing {firing['id']}: both policies on the same gate prompts\n\n"
                                          f"{answers_markdown(gate)}\n",
                                 description=f"line {line.name}, firing {firing['id']}: answers side by side")
    except Exception as error:  # the API away for a moment fails no firing: the ledger has the figures
        logger.warning("line %s: could not publish firing %d's gate artifacts: %s", line.name, firing["id"], error)


def publish_line(line: Line, ledger: Ledger) -> None:
    """The line's table: one row per firing, newest last (a new version per firing)."""
    from prefect.artifacts import create_table_artifact

    champion = ledger.champion
    try:
        create_table_artifact(key=artifact_key(line.name, "line"), table=line_rows(ledger) or [{"firing": None}],
                              description=f"line {line.name}: every firing; the champion is "
                                          f"{champion['run_id'] + ' (iteration ' + str(champion['iteration']) + ')' if champion else 'the base model'}")
    except Exception as error:
        logger.warning("line %s: could not publish its table: %s", line.name, error)


def emit(line: Line, kind: str, payload: dict[str, Any]) -> None:
    from prefect.context import FlowRunContext
    from prefect.events import emit_event

    context = FlowRunContext.get()
    related = ([{"prefect.resource.id": f"prefect.flow-run.{context.flow_run.id}", "prefect.resource.role": "flow-run"}]
               if context else [])
    try:
        emit_event(event=f"areal.line.{kind}", resource={"prefect.resource.id": f"areal.line.{line.name}",
                                                          "prefect.resource.name": line.name},
                   related=related, payload={"line": line.name, **payload})
    except Exception:  # an event that cannot be sent is worth a warning, never the firing
        logger.warning("could not emit areal.line.%s for line %s", kind, line.name, exc_info=True)
