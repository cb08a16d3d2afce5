"""The commands of `areal-pipeline`, one function each, called with the parsed arguments (cli/__init__.py)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path


def cmd_init_model(args) -> None:
    from areal_pipeline.config import TinyModelConfig
    from areal_pipeline.model import build_tiny_model
    from areal_pipeline.run_spec import load_config

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
    from areal_pipeline.run_spec import load_run

    run = load_run(args.config, args.overrides)
    cfg = run.cfg
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
    pipeline = Pipeline(run)
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
    """Prefect's temporary API server (when none is configured) and the services' forkserver (see forkserver.py)
    come up in the background from here on, while this process imports what the run needs. Yields the API server
    to pass to `prefect_api`; stops it if the block fails."""
    from areal_pipeline.services import start_forkserver
    from flows.api_server import early_api_server, needed_api_server

    api_server = early_api_server()
    try:
        start_forkserver()
        api_server = needed_api_server(api_server)
        yield api_server
    except BaseException:
        if api_server is not None:
            api_server.stop()
        raise


def cmd_node(args) -> None:
    from areal_pipeline.run_context import RunContext, run_attached_node

    def argument(value: str):
        return json.loads(Path(value[1:]).read_text() if value.startswith("@") else value)

    output = run_attached_node(RunContext.from_dict(argument(args.context)), args.step, args.k,
                               tuple(argument(args.inputs)))
    print(json.dumps(output, sort_keys=True))


def cmd_train(args) -> None:
    from areal_pipeline.data.datasets import check_local_rows
    from areal_pipeline.run_spec import resolve_run_config

    # Config errors first, then data errors, before anything starts (both need only light imports).
    cfg = resolve_run_config(args.config, args.overrides, args.run_id, args.iterations)
    check_local_rows(cfg.dataset, cfg.seed)
    with _api_and_forkserver() as api_server:
        from flows.api_server import prefect_api
        from flows.train import preimport_first_run, train

        from areal_pipeline.metrics import run_history, summarize
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
    summary = summarize(run_history(cfg.run_dir))  # eval pass@1 from the initial policy's
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
    from flows.api_server import require_api_access
    from flows.serve import serve_deployments

    require_api_access()  # a refused credential is said at once, naming the setting

    if args.recurring:
        from areal_pipeline.recurring.line import check_line_config
        from areal_pipeline.run_spec import load_config

        if args.run_id or args.iterations or args.eval_cron or args.eval_interval:
            sys.exit("serve --recurring: the line's config says its run id and iterations (recurring.*); --run-id, "
                     "--iterations and --eval-* are for the train deployments")
        check_line_config(load_config(args.config, args.overrides))
        serve_deployments(args.config, args.overrides, cron=args.cron, interval=args.interval,
                          poll_seconds=args.poll_seconds, recurring=True)
        return
    serve_deployments(args.config, args.overrides, args.run_id, args.iterations, cron=args.cron,
                      interval=args.interval, eval_cron=args.eval_cron, eval_interval=args.eval_interval,
                      poll_seconds=args.poll_seconds)


def cmd_export(args) -> None:
    from areal_pipeline.checksums import IntegrityError
    from areal_pipeline.data.export import FORMATS, ExportError, export_dataset, parse_iteration_range
    from areal_pipeline.weights_export import WeightExportError, export_weights

    run_dir = Path(args.output_dir) / args.run_id if args.run_id else None
    try:
        if args.format in FORMATS:
            if args.checkpoint is not None or args.base is not None:
                raise ExportError(f"--checkpoint and --base are for the weight formats (adapter, merged, full), not "
                                  f"--format {args.format}")
            if run_dir is None:
                raise ExportError(f"--format {args.format} needs --run-id")
            first, last = parse_iteration_range(args.iterations)
            result = export_dataset(run_dir, args.out, args.format, args.min_reward, first, last,
                                    keep_duplicates=args.keep_duplicates)
        else:
            if args.iterations is not None or args.keep_duplicates:
                raise WeightExportError(f"--iterations and --keep-duplicates are for the data sets (sft, "
                                        f"preference), not --format {args.format}")
            result = export_weights(run_dir, Path(args.out), args.format, args.checkpoint or "latest", args.base)
    except (ExportError, WeightExportError, IntegrityError) as e:
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


def cmd_rescore(args) -> None:
    from flows.rescore import main as rescore_main

    rescore_main(args)


def cmd_prefect_server(args) -> None:
    from areal_pipeline.prefect_server import LocalPrefectServer, PrefectServerError

    try:
        _prefect_server(LocalPrefectServer(args.dir), args)
    except PrefectServerError as e:
        sys.exit(f"prefect-server error: {e}")


def _prefect_server(server, args) -> None:
    """start | stop | status of a standing Prefect server on PostgreSQL. --auth-file: see `server_auth_string`."""
    from areal_pipeline.prefect_auth import (CLIENT_AUTH_ENV, apply_prefect_auth_file, client_auth_advice,
                                             server_auth_string)

    if args.action == "start":
        auth_string = server_auth_string(args.auth_file)
        url = server.start(args.port, args.pg_port, say=print, host=args.host, auth_string=auth_string)
        exports = [f"export PREFECT_API_URL={url}"]
        if auth_string:
            advice, export = client_auth_advice(args.auth_file)
            print(advice)
            exports += [export] if export else []
        print("\n" + "\n".join(exports))
    elif args.action == "stop":
        if server.server_pid() is None and not server.postgres_running():
            print(f"nothing of {server.dir} is running")
        server.stop(say=print)
    else:
        apply_prefect_auth_file()  # where the command line has not yet
        for key, value in server.status(os.environ.get(CLIENT_AUTH_ENV)).items():
            print(f"{key + ':':16}{value}")


def _submit_parts(plan, trainer_hosts: list[str]) -> None:
    """The servers and trainer nodes of `plan` as flow runs of the cluster-node deployment, on their hosts' queues."""
    import asyncio
    from dataclasses import asdict

    from areal_pipeline.cluster import command_line
    from flows.node import submit

    parts = [asdict(launch) for launch in plan if launch.role != "run"]
    nodes = [part for part in parts if part["role"] == "trainer-node"]
    if trainer_hosts:
        if len(trainer_hosts) != len(nodes) or (nodes[0]["host"] and trainer_hosts[0] != nodes[0]["host"]):
            sys.exit(f"cluster: --trainer-hosts must name {len(nodes)} host(s), the rendezvous host "
                     f"{nodes[0]['host'] or '(any)'} first; got {','.join(trainer_hosts)}")
        for part, host in zip(nodes, trainer_hosts):
            part["host"] = host
    unplaced = [part["role"] for part in parts if not part["host"]]
    if unplaced:
        sys.exit(f"cluster: --submit needs a host for every part: name the trainer nodes' hosts with "
                 f"--trainer-hosts ({len(nodes)} of them)")
    for part, run_id in zip(parts, asyncio.run(submit(parts))):
        print(f"{part['role']} on {part['host']}: flow run {run_id}")
    run = next(launch for launch in plan if launch.role == "run")
    print(f"\nthen, on the head: {command_line(run)}")


def cmd_trainer_node(args) -> None:
    from areal_pipeline.model import resolve_model_path
    from areal_pipeline.run_spec import load_config
    from areal_pipeline.training.nodes import TrainerNodeError, run_trainer_node
    from areal_pipeline.utils import exit_when_parent_dies

    cfg = load_config(args.config, args.overrides)
    exit_when_parent_dies()  # a node ends with whatever started it (a worker's flow run, srun), as a server does
    try:
        run_trainer_node(cfg, resolve_model_path(cfg.model, cfg.output_dir, cfg.seed), args.address)
    except TrainerNodeError as e:
        sys.exit(f"trainer-node: {e}")


def cmd_cluster(args) -> None:
    import os

    from areal_pipeline.auth import CredentialError
    from areal_pipeline.cluster import (ClusterConfigError, as_json, as_shell, as_slurm, credential_env, launch_plan,
                                        prefect_api_warning)
    from areal_pipeline.model import resolve_model_path
    from areal_pipeline.run_spec import load_config

    cfg = load_config(args.config, args.overrides)
    # the embedded model is built once, here, on the shared path, rather than by every host at once
    model_path = resolve_model_path(cfg.model, cfg.output_dir, cfg.seed)
    try:
        # the config by its absolute path: every host reads it from the shared file system
        plan = launch_plan(cfg, str(Path(args.config).resolve()), args.overrides, model_path,
                           os.environ.get("PREFECT_API_URL", ""), credential_env(cfg))
    except (ClusterConfigError, CredentialError) as e:
        sys.exit(f"cluster: {e}")
    warning = prefect_api_warning(os.environ.get("PREFECT_API_URL", ""))
    if warning:
        print(f"cluster: warning: {warning}", file=sys.stderr)
    if args.submit:
        _submit_parts(plan, [h for h in args.trainer_hosts.split(",") if h])
        return
    print({"shell": as_shell, "json": as_json}[args.format](plan) if args.format != "slurm"
          else as_slurm(plan, cfg, args.partition))


def cmd_sweep(args) -> None:
    from flows.sweep import main as sweep_main

    sweep_main(args)
