"""The `areal-pipeline` command line: above the flows it starts (flows/) and the library (areal_pipeline/), which
import nothing of it. `python -m cli ...` runs it too."""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from typing import Optional

from cli.commands import (cmd_answers, cmd_branch, cmd_config, cmd_evaluate, cmd_export, cmd_guard,
                          cmd_inference_server, cmd_init_model, cmd_node, cmd_prefect_server, cmd_retrieval_server,
                          cmd_rollout, cmd_rescore, cmd_serve, cmd_sweep, cmd_train, cmd_trainer_node, cmd_cluster)


def _api_grace(parser: argparse.ArgumentParser) -> None:
    def seconds(value: str) -> float:
        try:
            grace = float(value)
        except ValueError:
            grace = -1.0
        if not grace > 0:
            raise argparse.ArgumentTypeError(f"{value!r}: must be a positive number of seconds")
        return grace

    parser.add_argument("--api-grace", type=seconds, default=None, metavar="SECONDS",
                        help="how long the Prefect API may not answer before the run stops at its next node, "
                             "exit code 75, resumable by the same command (default: $AREAL_API_GRACE_S, else 120)")

def build_parser() -> argparse.ArgumentParser:
    from areal_pipeline.inference.server_args import build_arg_parser

    parser = argparse.ArgumentParser(prog="areal-pipeline", description="The `areal-pipeline` command line.")
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
    _api_grace(p)
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

    p = sub.add_parser("serve", help="serve the train, evaluate and sweep deployments (Prefect UI runs, schedules), "
                                     "or a recurring line's (--recurring)")
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
    p.add_argument("--recurring", action="store_true",
                   help="serve the recurring line of --config instead (its firings on --cron/--interval, its "
                        "rollback; and the servers the line runs itself, recurring.serve.num_servers)")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=cmd_serve)

    from cli.recurring import add_parser as add_recurring_parser

    add_recurring_parser(sub)

    p = sub.add_parser("export", help="a data set from a run's rollout shards (rejection-sampled SFT conversations "
                                      "or chosen/rejected pairs, as Parquet or JSON lines), or the weights of one of "
                                      "its checkpoints (a PEFT adapter, a merged or a full model directory)")
    p.add_argument("--run-id", default=None, help="the run (needed unless --checkpoint names a directory)")
    p.add_argument("--output-dir", default="runs", help="where the run directories are (the config's output_dir)")
    p.add_argument("--format", choices=["sft", "preference", "adapter", "merged", "full"], default="sft",
                   help="data sets: sft: accepted episodes as chat messages; preference: accepted vs rejected samples "
                        "of one prompt, paired within each group. Weights (--out is a directory): adapter: a LoRA "
                        "run's PEFT adapter directory, which PeftModel.from_pretrained, vLLM's --lora-modules and "
                        "SGLang's --lora-paths load as it is (LoRA runs only); merged: one Hugging Face model "
                        "directory with the tokenizer, for a LoRA run the base with the adapter merged in by peft "
                        "(merge_and_unload), for a full fine-tuning run the checkpoint's model/; full: the "
                        "checkpoint's model/ as the trainer saved it (for a LoRA run, the merged policy it served)")
    p.add_argument("--min-reward", type=float, default=1.0, help="a sample is accepted at this reward or above")
    p.add_argument("--iterations", default=None, metavar="A:B", help="only these iterations (K, A:B, A:, :B)")
    p.add_argument("--keep-duplicates", action="store_true",
                   help="sft: keep a conversation every time it was sampled (default: once)")
    p.add_argument("--checkpoint", default=None, metavar="latest|K|DIR",
                   help="weights: the run's newest saved checkpoint (latest, the default), step K's, or a checkpoint "
                        "directory (write ./K for a directory named by a number)")
    p.add_argument("--base", default=None, metavar="PATH",
                   help="--format merged of a LoRA run: the base model to merge the adapter onto (default: the "
                        "adapter's base_model_name_or_path, the run's model.path)")
    p.add_argument("--out", required=True,
                   help="a data set: FILE.parquet, FILE.jsonl or FILE.json (JSON lines); weights: a new (or empty) "
                        "directory")
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
    p.add_argument("--rescored", default=None, metavar="NAME",
                   help="with --replay: on the parent's shards as `areal-pipeline rescore --name NAME` re-scored them")
    p.add_argument("--output-dir", default="runs", help="where the parent's run directory is (and the new one goes)")
    p.add_argument("--verbose", action="store_true", help="every log record on the terminal, as train --verbose")
    p.add_argument("overrides", nargs="*",
                   help="dotted overrides of the parent's config, e.g. trainer.optimizer.lr=5e-4")
    p.set_defaults(func=cmd_branch)

    p = sub.add_parser("rescore", help="score a run's stored rollouts again with another reward (no generation), "
                                       "into new shards beside them; branch --replay --rescored trains on them")
    p.add_argument("--run-id", required=True, help="the run whose rollouts are re-scored")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--reward", default=None, metavar="MODULE:ATTR",
                       help="a reward function reward(completion, answer) -> float, 'module:attr' or 'file.py:attr'")
    which.add_argument("--group-reward", default=None, metavar="NAME",
                       help="a group reward scoring each prompt's group at once: judge, or 'module:attr' (a builder)")
    p.add_argument("--iterations", default=None, metavar="A:B", help="the iterations (inclusive; default: all)")
    p.add_argument("--name", default=None, help="the new shard set's name (default: from the reward)")
    p.add_argument("--output-dir", default="runs", help="where the run directory is")
    p.add_argument("overrides", nargs="*",
                   help="dotted overrides of the run's config (the judge's settings), e.g. rollout.reward_timeout=30")
    p.set_defaults(func=cmd_rescore)

    p = sub.add_parser("sweep", help="one train run per combination of the values given (cartesian product), at "
                                     "most --max-parallel at once, each its own flow run; a table of their figures")
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--run-id", default=None, help="the base of the runs' ids (default: the config's run_id); "
                                                  "each run is BASE-key=value[-key=value...]")
    p.add_argument("--iterations", type=int, default=None, help="as train --iterations, for every run")
    p.add_argument("--max-parallel", type=int, default=1, metavar="N", help="runs at once (default 1)")
    p.add_argument("--verbose", action="store_true", help="every log record of the sweep on the terminal (each "
                                                          "run's output goes to runs/<run_id>/logs/sweep.log)")
    _api_grace(p)
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
    p.add_argument("--host", default="127.0.0.1", help="the address the Prefect server listens on: an address of "
                                                       "this host that other hosts reach, for a run across hosts")
    p.add_argument("--auth-file", default=None, metavar="PATH",
                   help="start: demand the auth string in PATH (one line, mode 0600) of every client (Prefect's "
                        "basic auth; clients send PREFECT_API_AUTH_STRING). Default: $PREFECT_SERVER_API_AUTH_STRING, "
                        "else the file $AREAL_PIPELINE_PREFECT_AUTH_FILE names, else no authentication")
    p.set_defaults(func=cmd_prefect_server)

    p = sub.add_parser("trainer-node", help="this node's part of a trainer on nodes of its own (torchrun under it), "
                                            "as a scheduler starts it on each trainer node: docs/multi-node.md")
    p.add_argument("--config", required=True)
    p.add_argument("--address", default="", help="this node's address the other hosts reach (default: the one it "
                                                 "reaches trainer.rdzv_endpoint from, else its host name's)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, the same as the run's")
    p.set_defaults(func=cmd_trainer_node)

    p = sub.add_parser("cluster", help="the launch commands of a run across hosts (servers, trainer nodes, the run), "
                                       "generated from its config: for a shell on each host, or Slurm")
    p.add_argument("--config", required=True)
    p.add_argument("--format", choices=["shell", "slurm", "json"], default="shell")
    p.add_argument("--partition", default="", help="Slurm: the partition (--format slurm)")
    p.add_argument("--submit", action="store_true",
                   help="rather than print them, submit the servers and trainer nodes as flow runs of the "
                        "cluster-node deployment, each to the work queue of its host (a Prefect worker per host)")
    p.add_argument("--trainer-hosts", default="", help="--submit: the trainer nodes' hosts, comma-separated, the "
                                                       "rendezvous host first (default: that host alone)")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, passed on to every command")
    p.set_defaults(func=cmd_cluster)

    p = sub.add_parser("rollout", help="roll out one iteration's batch into Parquet shards, or show N decoded "
                                       "episodes (--show N)")
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--iteration", type=int, default=1, help="k: rolled out with the run's policy k - 1")
    p.add_argument("--show", type=int, default=None, metavar="N",
                   help="roll out the first N prompts of the batch afresh and print each episode decoded (prompt, "
                        "turns, tool results, reward); writes no shards and never reuses a cached rollout")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. rollout.gconfig.n_samples=8")
    p.set_defaults(func=cmd_rollout)

    from areal_pipeline.steps import BY_NAME

    p = sub.add_parser("node", help="run one node of a live run in this process, against the run's running services "
                                    "(what a worker elsewhere runs); prints the node's output record as JSON")
    p.add_argument("step", choices=list(BY_NAME))
    p.add_argument("k", type=int, help="the iteration")
    p.add_argument("--context", required=True, metavar="JSON|@FILE",
                   help="the run's context, as the train flow hands it to its nodes (run_dir, run_id and the services' "
                        "addresses: areal_pipeline/run_context.py)")
    p.add_argument("--inputs", default="[]", metavar="JSON|@FILE",
                   help="the output records of the steps it takes, a JSON list in the step table's order (null for a "
                        "step not run this iteration)")
    p.set_defaults(func=cmd_node)
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


FLOW_COMMANDS = ("train", "evaluate", "branch", "sweep", "rescore", "recurring")


def main(argv: Optional[list[str]] = None) -> None:
    from areal_pipeline import shutdown

    args = build_parser().parse_args(argv)
    from areal_pipeline.prefect_auth import PrefectAuthError, apply_prefect_auth_file

    try:  # before anything reads Prefect's settings: this process and every one it starts send the string
        apply_prefect_auth_file()
    except PrefectAuthError as e:
        sys.exit(f"{args.command}: {e}")
    # Ctrl-C and SIGTERM (`kill`, `timeout`, a cancelled deployment run) stop the run's processes at once, then
    # unwind; the process ends within seconds whatever happens next (see areal_pipeline/shutdown.py)
    shutdown.install_handlers()
    if getattr(args, "api_grace", None) is not None:  # read by the train flow, here and in a sweep's runs
        import os

        os.environ["AREAL_API_GRACE_S"] = repr(args.api_grace)
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
