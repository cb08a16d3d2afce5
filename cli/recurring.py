"""`areal-pipeline recurring ...`: a line of champions from the command line (docs/recurring.md).

    fire        one firing in the foreground, exactly what the line's schedule fires (exit 0 whether promoted or
                rejected; the decision and the figures printed)
    status      the champion and every firing (--json: one object)
    rollback    publish an earlier champion again (--to RUN, or base), recorded as a firing
    demo-data   the embedded default's next file of fresh questions
    approve     answer a firing that waits for a person (recurring.approval=manual), as the UI's form does
    abandon     end an unfinished firing for good (its files stay new for the next firing)
"""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(sub) -> None:
    p = sub.add_parser("recurring", help="a line of champions: each firing trains a candidate from the champion on "
                                         "the new data, gates it, promotes it (docs/recurring.md)")
    actions = p.add_subparsers(dest="action", required=True)

    def action(name: str, help: str) -> argparse.ArgumentParser:
        a = actions.add_parser(name, help=help)
        a.add_argument("--config", default="configs/recurring_cpu.yaml")
        return a

    a = action("fire", "one firing in the foreground: what the line's schedule fires")
    a.add_argument("--verbose", action="store_true", help="every log record on the terminal")
    a.add_argument("overrides", nargs="*", help="dotted overrides for this firing's candidate, e.g. "
                                                "trainer.optimizer.lr=5e-4")
    a = action("status", "the line's champion and every firing")
    a.add_argument("--json", action="store_true", help="one JSON object")
    a.add_argument("overrides", nargs="*")
    a = action("rollback", "publish an earlier champion again, recorded as a firing")
    a.add_argument("--to", default=None, metavar="RUN", help="an earlier champion's run id, or base (default: the "
                                                             "champion before the current one)")
    a.add_argument("overrides", nargs="*")
    a = action("demo-data", "write the embedded default's next file of fresh questions into dataset.path")
    a.add_argument("--rows", type=int, default=None, help="questions in the file (default 160)")
    a.add_argument("overrides", nargs="*")
    a = action("approve", "answer the firing that waits for approval (recurring.approval=manual)")
    a.add_argument("--reject", action="store_true", help="reject the candidate (default: approve it)")
    a.add_argument("--reason", default="", help="why (kept in the ledger)")
    a.add_argument("--by", default="", help="who answers (kept in the ledger; default: $USER)")
    a.add_argument("overrides", nargs="*")
    a = action("abandon", "end the line's unfinished firing for good")
    a.add_argument("--reason", default="abandoned", help="why (kept in the ledger)")
    a.add_argument("overrides", nargs="*")
    p.set_defaults(func=cmd_recurring)


def cmd_recurring(args) -> None:
    from areal_pipeline.config import ConfigError
    from areal_pipeline.recurring.ledger import LedgerError, LineBusyError

    try:
        {"fire": _fire, "status": _status, "rollback": _rollback, "demo-data": _demo_data, "approve": _approve,
         "abandon": _abandon}[args.action](args)
    except (LedgerError, LineBusyError) as error:
        sys.exit(f"recurring: {error}")
    except ConfigError:
        raise


def _line(args):
    from areal_pipeline.recurring.line import Line, check_line_config
    from areal_pipeline.run_spec import load_config

    cfg = load_config(args.config, args.overrides)
    if args.action in ("fire", "rollback"):
        check_line_config(cfg)
    return Line(cfg)


def _fire(args) -> None:
    from cli.commands import _api_and_forkserver

    line = _line(args)
    ledger = line.read_ledger()
    unfinished = ledger.open_firing if ledger else None
    firing_id = unfinished["id"] if unfinished else (ledger.next_id if ledger else 1)
    with _api_and_forkserver() as api_server:
        from areal_pipeline.model import resolve_model_path
        from flows.api_server import prefect_api
        from flows.recurring import recurring
        from flows.train import preimport_first_run

        resolve_model_path(line.cfg.model, line.cfg.output_dir, line.cfg.seed)
        preimport_first_run()
    from areal_pipeline.console import quiet_console
    from flows.events import listening

    with quiet_console(line.candidate_run_id(firing_id), line.dir, args.verbose, log_name="fire.log") as progress, \
            listening(progress), prefect_api(api_server):
        result = recurring(config_path=args.config, overrides=args.overrides)
    print(_decision_text(result))


def _decision_text(result: dict) -> str:
    gate = result.get("gate")
    text = f"\nline {result['line']}, firing {result['firing']}: {result['decision']}"
    if result["decision"] == "no_data":
        return text + f" ({result['reason']}); nothing trained"
    text += f" - candidate {result['run_id']} on {result['rows']} new rows (+{result['replay_rows']} replayed)"
    if gate:
        text += (f"\n  gate ({gate['test']}, {gate['prompts']} prompts): champion mean reward "
                 f"{gate['champion']['mean_reward']:.3f} / pass@1 {gate['champion']['pass_at_1']:.3f}, candidate "
                 f"{gate['candidate']['mean_reward']:.3f} / {gate['candidate']['pass_at_1']:.3f}; improvement "
                 f"{gate['improvement']:+.3f}, p = {gate['p_value']:.3g}")
    verdict = "approved" if result["decision"] == "promoted" else "rejected"
    return text + f"\n  {verdict} by {result['approved_by']}: {result['reason']}"


def _status(args) -> None:
    from areal_pipeline.recurring.status import line_status, status_text

    line = _line(args)
    ledger = line.read_ledger()
    if ledger is None:
        if args.json:
            print(json.dumps({"line": line.name, "champion": None, "firings": []}))
        else:
            print(f"line {line.name}: no firing yet ({line.ledger_path} does not exist)")
        return
    from areal_pipeline.recurring.ledger import lock_is_held

    status = line_status(ledger, busy=lock_is_held(line.dir))
    print(json.dumps(status, indent=1) if args.json else status_text(status))


def _rollback(args) -> None:
    from flows.recurring import RollbackError

    line = _line(args)
    from flows.api_server import prefect_api
    from flows.recurring import recurring_rollback

    try:
        with prefect_api():
            result = recurring_rollback(config_path=args.config, overrides=args.overrides, to=args.to)
    except RollbackError as error:
        sys.exit(f"recurring rollback: {error}")
    print(f"line {line.name}, firing {result['firing']}: {result['reason']}")


def _demo_data(args) -> None:
    from pathlib import Path

    from areal_pipeline.config import read_layers
    from areal_pipeline.config.loading import layered_value
    from areal_pipeline.data.datasets import DatasetError
    from areal_pipeline.recurring.demo import DEMO_ROWS, write_demo_file

    directory = layered_value(read_layers(args.config, args.overrides), "dataset.path", "")[0]
    if directory:  # the first file makes the directory the config names (which must exist to load it)
        Path(directory).expanduser().mkdir(parents=True, exist_ok=True)
    line = _line(args)
    try:
        path, rows = write_demo_file(line.cfg, args.rows or DEMO_ROWS)
    except DatasetError as error:
        sys.exit(f"recurring demo-data: {error}")
    print(f"wrote {rows} questions to {path}: the next firing of line {line.name} trains on them")


def _approve(args) -> None:
    import asyncio
    import getpass

    from areal_pipeline.run_dir import read_json

    line = _line(args)
    ledger = line.read_ledger()
    unfinished = ledger.open_firing if ledger else None
    request = read_json(line.firing_dir(unfinished["id"]) / "approval-request.json") if unfinished else None
    if request is None or read_json(line.firing_dir(unfinished["id"]) / "approval.json") is not None:
        sys.exit(f"recurring approve: no firing of line {line.name} waits for approval")
    answer = {"approve": not args.reject, "reason": args.reason, "approver": args.by or getpass.getuser()}

    async def resume():
        from prefect.client.orchestration import get_client

        async with get_client() as client:
            return await client.resume_flow_run(request["flow_run_id"], run_input=answer)
    result = asyncio.run(resume())
    if str(getattr(result.status, "value", result.status)).upper() != "ACCEPT":
        sys.exit(f"recurring approve: Prefect did not take the answer: {result.details}")
    print(f"line {line.name}, firing {unfinished['id']}: {'approved' if answer['approve'] else 'rejected'} "
          f"by {answer['approver']} (the firing goes on)")


def _abandon(args) -> None:
    line = _line(args)
    with line.lock():
        ledger = line.read_ledger()
        unfinished = ledger.open_firing if ledger else None
        if unfinished is None:
            sys.exit(f"recurring abandon: line {line.name} has no unfinished firing")
        ledger.end_firing(unfinished, "failed", reason=args.reason)
        ledger.save()
    print(f"line {line.name}: firing {unfinished['id']} ended as failed ({args.reason}); its files stay new")
