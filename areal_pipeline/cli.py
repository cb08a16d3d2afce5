"""The `areal-pipeline` command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import traceback
from pathlib import Path
from typing import Optional


def _config(args):
    from areal_pipeline.run_spec import load_config

    return load_config(args.config, args.overrides)


def cmd_init_model(args) -> None:
    from areal_pipeline.config import TinyModelConfig
    from areal_pipeline.run_spec import load_config
    from areal_pipeline.model import build_tiny_model

    tiny = load_config(None, [f"model.tiny.{o}" for o in args.overrides]).model.tiny if args.overrides else TinyModelConfig()
    path = build_tiny_model(args.out_dir, tiny, seed=args.seed)
    print(f"wrote the embedded tiny model to {path}")


def cmd_inference_server(args) -> None:
    from areal_pipeline.inference import server

    del args.func  # the server shows its arguments (/get_server_info): settings only
    server.serve(args)


def cmd_retrieval_server(args) -> None:
    from areal_pipeline.tools import retrieval_server

    retrieval_server.serve(args)


def cmd_rollout(args) -> None:
    from areal_pipeline.config import save_config
    from areal_pipeline.pipeline import Pipeline
    from areal_pipeline.run_dir import run_lock

    cfg = _config(args)
    if args.show is not None:  # episodes for people: always rolled out afresh, nothing written but server logs
        from areal_pipeline.rollout.try_workflow import format_episode, tokenizer_for, try_workflow

        if args.show < 1:
            sys.exit(f"rollout: --show N needs N >= 1, got {args.show}")

        trajectories = try_workflow(cfg, args.show, iteration=args.iteration, progress=True)
        tokenizer = tokenizer_for(cfg)
        episodes: dict[str, int] = {}  # an episode's trajectories share its group id
        for t in trajectories:
            print(format_episode(t, tokenizer, index=episodes.setdefault(t.group_id, len(episodes))))
        n = len(trajectories)
        print(f"\n{args.show} episode(s) of {cfg.rollout.workflow} rolled out now ({n} trajectories): "
              f"mean reward {sum(t.reward for t in trajectories) / max(1, n):.3f}")
        return
    pipeline = Pipeline(cfg)
    with run_lock(cfg.run_dir):
        try:
            save_config(cfg, cfg.run_dir / "config.yaml")
            pipeline.prepare_dataset()
            pipeline.services.start_tools()
            pipeline.services.start_inference()
            stats = pipeline.rollout(args.iteration, progress=True)
        finally:
            pipeline.close()
            pipeline.services.stop()
    print(json.dumps(stats, indent=2))
    print(f"shards: {pipeline.paths.rollout(args.iteration)}")
    if stats.get("cached"):
        print(f"NOTE: iteration {args.iteration}'s rollout was already written: these are its recorded stats, "
              f"nothing was rolled out now (delete {pipeline.paths.rollout(args.iteration)} to roll it out again, "
              f"or use --show N to see fresh episodes)", file=sys.stderr)


@contextlib.contextmanager
def _api_and_forkserver():
    """Prefect's temporary API server (when none is configured) comes up in the background from here on, while
    this process imports what the run needs; once it has imported what its services need too, a fork of it
    becomes their forkserver (see forkserver.py), which imports the rest of theirs while this process imports
    Prefect's flow machinery. Yields the API server to pass to `prefect_api`; stops it if the block fails."""
    from areal_pipeline import forkserver
    from flows.api_server import early_api_server, needed_api_server

    api_server = early_api_server()
    try:
        forkserver.start_here()
        api_server = needed_api_server(api_server)
        yield api_server
    except BaseException:
        if api_server is not None:
            api_server.stop()
        raise


def cmd_train(args) -> None:
    from areal_pipeline.run_spec import resolve_run_config
    from areal_pipeline.data.datasets import check_local_rows

    # Config errors first, then data errors, before anything starts (both need only light imports).
    cfg = resolve_run_config(args.config, args.overrides, args.run_id, args.iterations)
    check_local_rows(cfg.dataset, cfg.seed)
    with _api_and_forkserver() as api_server:
        from flows.api_server import prefect_api
        from flows.train import preimport_first_run, train

        from areal_pipeline.metrics import read_metrics, summarize
        from areal_pipeline.model import resolve_model_path

        resolve_model_path(cfg.model, cfg.output_dir, cfg.seed)
        preimport_first_run()
    from areal_pipeline.console import quiet_console
    from flows.events import listening

    # a progress line and warnings on the terminal; every record to the run's log file and Prefect's run logs
    with quiet_console(cfg.run_id, cfg.run_dir, args.verbose) as progress, listening(progress):
        with prefect_api(api_server):
            result = train(config_path=args.config, overrides=args.overrides, run_id=args.run_id,
                           iterations=args.iterations)
    records = read_metrics(cfg.run_dir / "metrics.jsonl")
    summary = summarize(records)
    print(f"\nrun {cfg.run_id}: {summary.get('iterations', 0)} iterations in {cfg.run_dir}")
    if summary:
        print(f"  mean reward, first {summary['window']} iterations: {summary['reward_first']:.3f}")
        print(f"  mean reward, last {summary['window']} iterations:  {summary['reward_last']:.3f}")
        if summary["eval_pass_at_1_last"] is not None:
            print(f"  eval pass@1: {summary['eval_pass_at_1_first']:.3f} -> {summary['eval_pass_at_1_last']:.3f}")
        for key, (first, last) in summary["agent"].items():  # the agent's own figures, first vs last window
            if first is not None and last is not None:
                print(f"  {key}: {first:.3f} -> {last:.3f}")
    print(f"  reward curve: {result.get('curve', cfg.run_dir / 'reward_curve.png')}")
    print(f"  metrics:      {cfg.run_dir / 'metrics.jsonl'}")


def cmd_evaluate(args) -> None:
    with _api_and_forkserver() as api_server:
        from flows.api_server import prefect_api
        from flows.evaluate import evaluate
    with prefect_api(api_server):
        result = evaluate(config_path=args.config, overrides=args.overrides, run_id=args.run_id,
                          checkpoint=args.checkpoint)
    print(json.dumps(result, indent=2))


def cmd_answers(args) -> None:
    from areal_pipeline.workflows.multi_turn import write_answer_logs

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise SystemExit(f"answers: no run directory {run_dir}")
    out = Path(args.out) if args.out else run_dir / "answers"
    files = write_answer_logs(run_dir, out)
    versions = {f.parent.name for f in files}
    print(f"{len(files)} files for {len(versions)} policy versions in {out}")


def cmd_config(args) -> None:
    from areal_pipeline.config_help import key_help

    print("\n\n".join(key_help(key, workflow=args.workflow) for key in (args.keys or [""])))


def cmd_serve(args) -> None:
    from flows.serve import serve_deployments

    serve_deployments(args.config, args.overrides, args.run_id, args.iterations, cron=args.cron,
                      interval=args.interval, eval_cron=args.eval_cron, eval_interval=args.eval_interval,
                      poll_seconds=args.poll_seconds)


def cmd_export(args) -> None:
    from areal_pipeline.data.export import ExportError, export_dataset, parse_iteration_range

    try:
        first, last = parse_iteration_range(args.iterations)
        result = export_dataset(Path(args.output_dir) / args.run_id, args.out, args.format, args.min_reward,
                                first, last, keep_duplicates=args.keep_duplicates)
    except ExportError as e:
        sys.exit(f"export error: {e}")
    print(result.describe())


def cmd_guard(args) -> None:
    import asyncio

    from flows.guard import GuardError, create_guards, remove_guards, require_server

    try:
        url = require_server()
        if args.remove:
            removed = asyncio.run(remove_guards(args.run_id))
            print(f"removed {len(removed)} guard automation(s) of run {args.run_id} from {url}: {', '.join(removed)}")
            return
        created = asyncio.run(create_guards(args.run_id, args.reward_drop, args.kl_above, args.kl_metric,
                                            args.action, args.notify))
    except GuardError as e:
        sys.exit(f"guard error: {e}")
    for guard in created:
        notify = f", and notify through {guard['notify']}" if guard["notify"] else ""
        print(f"automation {guard['name']} ({guard['id']}) on {url}: {guard['action']} the train flow run of "
              f"{args.run_id} when {guard['condition']}{notify}")


def cmd_branch(args) -> None:
    from flows.branch import main as branch_main

    branch_main(args)


def cmd_prefect_server(args) -> None:
    from areal_pipeline.prefect_server import PrefectServerError, main as server_main

    try:
        server_main(args.action, args.dir, args.port, args.pg_port)
    except PrefectServerError as e:
        sys.exit(f"prefect-server error: {e}")


def cmd_sweep(args) -> None:
    from flows.sweep import main as sweep_main

    sweep_main(args)


def build_parser() -> argparse.ArgumentParser:
    from areal_pipeline.inference.server_args import build_arg_parser

    parser = argparse.ArgumentParser(prog="areal-pipeline", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("init-model", help="write the embedded tiny Qwen2 model + tokenizer as a HF directory")
    p.add_argument("out_dir")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("overrides", nargs="*", help="tiny model settings, e.g. hidden_size=256 num_hidden_layers=6")
    p.set_defaults(func=cmd_init_model)

    server_parser = build_arg_parser()
    p = sub.add_parser("inference-server", parents=[server_parser], add_help=False, conflict_handler="resolve",
                       help="serve a model over SGLang's HTTP API on CPU")
    p.set_defaults(func=cmd_inference_server)

    from areal_pipeline.tools.retrieval_args import build_arg_parser as retrieval_arg_parser

    p = sub.add_parser("retrieval-server", parents=[retrieval_arg_parser()], add_help=False,
                       conflict_handler="resolve", help="serve BM25 (or dense) retrieval over a jsonl corpus")
    p.set_defaults(func=cmd_retrieval_server)

    p = sub.add_parser("train", help="run the train flow: one Prefect child flow run per RL iteration")
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--run-id", default=None, help="default: the config's run_id")
    p.add_argument("--iterations", type=int, default=None,
                   help="continue the run for N more iterations (default: up to total_iterations)")
    p.add_argument("--verbose", action="store_true",
                   help="every log record on the terminal (default: a progress line and warnings; all records go to "
                        "runs/<run_id>/logs/train.log and the Prefect run logs)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. trainer.optimizer.lr=1e-4")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("evaluate", help="pass@1 and mean reward of a checkpoint on the test split")
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--run-id", default=None)
    p.add_argument("--checkpoint", default="latest",
                   help="a checkpoint dir, an HF model dir, or 'latest' (the run's newest checkpoint)")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("answers", help="a run's answers per policy version as MathMultiTurnAgent logs them: "
                                       "OUT/<version>/<prompt_id>.txt and .jsonl")
    p.add_argument("run_dir", help="the run's directory, e.g. runs/gsm8k-multi-turn")
    p.add_argument("--out", default=None, help="where the version directories go (default: RUN_DIR/answers)")
    p.set_defaults(func=cmd_answers)

    p = sub.add_parser("config", help="what config keys mean: type, default, allowed values, documentation")
    p.add_argument("keys", nargs="*", help="dotted keys or sections, e.g. ppo.loss rollout.gconfig (none: the sections)")
    p.add_argument("--workflow", default=None,
                   help="document rollout.agent as this workflow's section: a built-in name, module:Class or "
                        "path/to/file.py:Class")
    p.set_defaults(func=cmd_config)

    p = sub.add_parser("serve", help="serve the train, evaluate and sweep deployments (Prefect UI runs, schedules)")
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--run-id", default=None)
    p.add_argument("--iterations", type=int, default=None, help="iterations a train run adds to its run")
    when = p.add_mutually_exclusive_group()
    when.add_argument("--cron", default=None, help="schedule train runs, e.g. '0 * * * *'")
    when.add_argument("--interval", type=float, default=None, help="schedule train runs every N seconds")
    eval_when = p.add_mutually_exclusive_group()
    eval_when.add_argument("--eval-cron", default=None)
    eval_when.add_argument("--eval-interval", type=float, default=None)
    p.add_argument("--poll-seconds", type=float, default=None,
                   help="how often to ask the API for runs to start (default: PREFECT_RUNNER_POLL_FREQUENCY if set, "
                        "else 2; Prefect's own default is 10)")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("export", help="a data set from a run's rollout shards: rejection-sampled SFT conversations "
                                      "or chosen/rejected pairs, as Parquet or JSON lines")
    p.add_argument("--run-id", required=True)
    p.add_argument("--output-dir", default="runs", help="where the run directories are (the config's output_dir)")
    p.add_argument("--format", choices=["sft", "preference"], default="sft",
                   help="sft: accepted episodes as chat messages; preference: accepted vs rejected samples of one "
                        "prompt, paired within each group")
    p.add_argument("--min-reward", type=float, default=1.0, help="a sample is accepted at this reward or above")
    p.add_argument("--iterations", default=None, metavar="A:B", help="only these iterations (K, A:B, A:, :B)")
    p.add_argument("--keep-duplicates", action="store_true",
                   help="sft: keep a conversation every time it was sampled (default: once)")
    p.add_argument("--out", required=True, help="FILE.parquet, FILE.jsonl or FILE.json (JSON lines)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("guard", help="Prefect automations on your Prefect server that cancel or pause a run's "
                                     "train flow run when its reward collapses or its KL spikes")
    p.add_argument("--run-id", required=True)
    p.add_argument("--reward-drop", type=float, default=None, metavar="D",
                   help="trip when the reward's 3-iteration average is D or more below its best so far")
    p.add_argument("--kl-above", type=float, default=None, metavar="X", help="trip when the KL rises above X")
    p.add_argument("--kl-metric", choices=["kl", "approx_kl"], default="kl",
                   help="kl: to the reference policy (computed when ppo.kl_ctl > 0); approx_kl: the update's, "
                        "behaviour vs new policy")
    p.add_argument("--action", choices=["cancel", "pause"], default="cancel",
                   help="cancel the flow run (the run id continues later), or pause it until resumed in the UI")
    p.add_argument("--notify", default=None, metavar="BLOCK_TYPE/NAME",
                   help="also send a notification through this block, e.g. slack-webhook/alerts")
    p.add_argument("--remove", action="store_true", help="delete the run's guard automations instead")
    p.set_defaults(func=cmd_guard)

    p = sub.add_parser("branch", help="a new run from another run's policy after iteration K, with new "
                                      "hyperparameters (--replay: retrain its later iterations on its recorded shards)")
    p.add_argument("--from", dest="parent", required=True, metavar="RUN", help="the run id to branch from")
    p.add_argument("--at", type=int, required=True, metavar="K", help="start from its policy after iteration K")
    p.add_argument("--run-id", required=True, help="the new run's id")
    p.add_argument("--iterations", type=int, default=None,
                   help="iterations after K (default: up to the config's total_iterations; --replay: every "
                        "iteration the parent recorded)")
    p.add_argument("--replay", action="store_true",
                   help="retrain the parent's iterations K+1.. on its recorded rollout shards (no new rollouts)")
    p.add_argument("--output-dir", default="runs", help="where the parent's run directory is (and the new one goes)")
    p.add_argument("--verbose", action="store_true", help="every log record on the terminal, as train --verbose")
    p.add_argument("overrides", nargs="*",
                   help="dotted overrides of the parent's config, e.g. trainer.optimizer.lr=5e-4")
    p.set_defaults(func=cmd_branch)

    p = sub.add_parser("sweep", help="one train run per combination of the values given (cartesian product), at "
                                     "most --max-parallel at once, each its own flow run; a table of their figures")
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--run-id", default=None, help="the base of the runs' ids (default: the config's run_id); "
                                                  "each run is BASE-key=value[-key=value...]")
    p.add_argument("--iterations", type=int, default=None, help="as train --iterations, for every run")
    p.add_argument("--max-parallel", type=int, default=1, metavar="N", help="runs at once (default 1)")
    p.add_argument("--verbose", action="store_true", help="every log record of the sweep on the terminal (each "
                                                          "run's output goes to runs/<run_id>/logs/sweep.log)")
    p.add_argument("axes", nargs="+", metavar="key=v1,v2,...",
                   help="dotted config keys and their values, comma-separated; a single value applies to every run")
    p.set_defaults(func=cmd_sweep)

    p = sub.add_parser("prefect-server", help="a standing Prefect server on a local PostgreSQL (initdb/pg_ctl "
                                              "from PATH), on 127.0.0.1: start, stop, status")
    p.add_argument("action", choices=["start", "stop", "status"])
    p.add_argument("--dir", default=None, help="where the database and the server's files live (default: "
                                               "~/.local/state/areal-pipeline/prefect-server; as root "
                                               "/var/lib/areal-pipeline/prefect-server)")
    p.add_argument("--port", type=int, default=4200, help="the Prefect API and UI port")
    p.add_argument("--pg-port", type=int, default=5433, help="PostgreSQL's port (127.0.0.1)")
    p.set_defaults(func=cmd_prefect_server)

    p = sub.add_parser("rollout", help="roll out one iteration's batch into Parquet shards, or show N decoded "
                                       "episodes (--show N)")
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--iteration", type=int, default=1, help="k: rolled out with the run's policy k - 1")
    p.add_argument("--show", type=int, default=None, metavar="N",
                   help="roll out the first N prompts of the batch afresh and print each episode decoded (prompt, "
                        "turns, tool results, reward); writes no shards and never reuses a cached rollout")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. rollout.n_samples=8")
    p.set_defaults(func=cmd_rollout)
    return parser


def _interrupted_message(args) -> str:
    import signal

    from areal_pipeline import shutdown

    signum = shutdown.requested_by() or signal.SIGINT
    message = f"interrupted by {signal.Signals(signum).name}: servers and trainer were stopped"
    if args.command == "train":
        again = " ".join(["areal-pipeline train", f"--config {args.config}",
                          *([f"--run-id {args.run_id}"] if args.run_id else []), *args.overrides])
        message += f". To continue the run from its last finished step: {again}"
    return message


FLOW_COMMANDS = ("train", "evaluate", "branch", "sweep")


def main(argv: Optional[list[str]] = None) -> None:
    from areal_pipeline import shutdown

    args = build_parser().parse_args(argv)
    # Ctrl-C and SIGTERM (`kill`, `timeout`, a cancelled deployment run) stop the run's processes at once, then
    # unwind; the process ends within seconds whatever happens next (see areal_pipeline/shutdown.py)
    shutdown.install_handlers()
    if args.command != "inference-server":
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per Prefect API call otherwise
    from areal_pipeline.config import ConfigError
    from areal_pipeline.data.datasets import DatasetError

    from areal_pipeline.run_dir import RunLockedError

    try:
        args.func(args)
    except ConfigError as e:
        sys.exit(f"config error: {e}")
    except DatasetError as e:
        sys.exit(f"data error: {e}")
    except RunLockedError as e:
        sys.exit(str(e))
    except Exception as error:
        if args.command not in FLOW_COMMANDS:  # a flow run has logged the traceback already
            traceback.print_exc()
        # the cause, as the last line the user sees
        sys.exit(f"{args.command} failed: {type(error).__name__}: {error}")
    except KeyboardInterrupt:
        import signal

        print(_interrupted_message(args), file=sys.stderr)
        sys.exit(shutdown.exit_status(shutdown.requested_by() or signal.SIGINT))


if __name__ == "__main__":
    main()
