"""The `areal-pipeline` command line."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Optional


def _config(args):
    from areal_pipeline.config import load_config

    return load_config(args.config, args.overrides)


def cmd_init_model(args) -> None:
    from areal_pipeline.config import TinyModelConfig, load_config
    from areal_pipeline.model import build_tiny_model

    tiny = load_config(None, [f"model.tiny.{o}" for o in args.overrides]).model.tiny if args.overrides else TinyModelConfig()
    path = build_tiny_model(args.out_dir, tiny, seed=args.seed)
    print(f"wrote the embedded tiny model to {path}")


def cmd_inference_server(args) -> None:
    from areal_pipeline.inference import server

    server.serve(args)


def cmd_rollout(args) -> None:
    from areal_pipeline.rollout.job import rollout_dir, run_rollout_job

    cfg = _config(args)
    manifest = run_rollout_job(cfg, iteration=args.iteration)
    stats = manifest["stats"]
    print(json.dumps(stats, indent=2))
    print(f"shards: {rollout_dir(cfg, args.iteration)}")


def build_parser() -> argparse.ArgumentParser:
    from areal_pipeline.inference.server import build_arg_parser

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

    p = sub.add_parser("rollout", help="roll out one iteration's batch into Parquet shards")
    p.add_argument("--config", default="configs/tiny_cpu.yaml")
    p.add_argument("--iteration", type=int, default=0)
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. rollout.n_samples=8")
    p.set_defaults(func=cmd_rollout)
    return parser


def main(argv: Optional[list[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    if args.command != "inference-server":
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from areal_pipeline.config import ConfigError

    try:
        args.func(args)
    except ConfigError as e:
        sys.exit(f"config error: {e}")


if __name__ == "__main__":
    main()
