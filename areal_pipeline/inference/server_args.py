"""The CPU inference server's command line, apart from the server so that a command that only lists its options
(`areal-pipeline --help`, the parser of every subcommand) does not import torch and aiohttp for it."""

from __future__ import annotations

import argparse

DEFAULT_MAX_BODY_BYTES = 64 << 20


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="SGLang-API-compatible CPU inference server")
    p.add_argument("--model", "--model-path", dest="model", required=True, help="HF model directory or hub id")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--max-batch-size", type=int, default=128)
    p.add_argument("--context-length", type=int, default=0, help="0: the model's max_position_embeddings")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", type=_device,
                   help="cpu, cuda or cuda:N: where the model and everything the engine builds live")
    p.add_argument("--mem-fraction-static", type=float, default=None,
                   help="on CUDA, the share of the GPU's memory this server may allocate (as SGLang's flag; for a "
                        "GPU shared with the trainer); default: no cap")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-threads", type=int, default=0, help="torch intra-op threads (0: default)")
    p.add_argument("--weight-version", default="0")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--log-level", default="info")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="largest request body taken (413 beyond)")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="honour a request's sampling_seed (as SGLang's flag: without it the seed is ignored)")
    p.add_argument("--health-check-timeout", type=float, default=20.0,
                   help="seconds /health waits for a paused server to continue before answering 503 (as SGLang's "
                        "SGLANG_HEALTH_CHECK_TIMEOUT)")
    p.add_argument("--weights-root", action="append", default=[], metavar="DIR",
                   help="a directory /update_weights_from_disk may load from (repeatable): a model_path must resolve, "
                        "symlinks followed, inside one; with none every disk load is refused")
    p.add_argument("--weight-group-master", action="append", default=[], metavar="HOST",
                   help="the only master addresses /init_weights_update_group joins (repeatable; the trainer's); "
                        "default: any")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters loaded at run time (/load_lora_adapter; SGLang's flag): one at a time, "
                        "merged into the base (see areal_pipeline/inference/lora_serving.py)")
    p.add_argument("--max-lora-rank", type=int, default=0, help="the largest adapter rank a load takes")
    p.add_argument("--lora-target-modules", nargs="+", default=["all"],
                   help="the modules an adapter may adapt (q_proj ... down_proj, or all)")
    p.add_argument("--max-loaded-loras", type=int, default=1, choices=[1],
                   help="adapters held at once: 1, merged into the base (a load evicts the one before)")
    p.add_argument("--record-dir", default=None, metavar="DIR",
                   help="record every chat completion served, and take POST /v1/feedback, into DIR (journals "
                        "sealed into Parquet shards: areal_pipeline/online/traffic_log.py); default: record nothing")
    p.add_argument("--record-rotate-bytes", type=_positive_int, default=64 << 20, metavar="N",
                   help="seal the open journal into a shard once it passes N bytes")
    p.add_argument("--record-rotate-s", type=_positive_float, default=3600.0, metavar="S",
                   help="... or once it is older than S seconds")
    p.add_argument("--record-retention-days", type=_non_negative_float, default=0.0, metavar="D",
                   help="remove sealed shards whose newest record is older than D days, at start and at each "
                        "rotation (0: keep them forever)")
    return p


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive integer")
    return number


def _positive_float(value: str) -> float:
    number = float(value)
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r} is not a positive number of seconds")
    return number


def _non_negative_float(value: str) -> float:
    number = float(value)
    if not 0 <= number < float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r} is not a number >= 0")
    return number


def _device(value: str) -> str:
    """--device as torch names it; cuda:N must be a number (whether that GPU exists is checked at start-up)."""
    kind, _, index = value.partition(":")
    if kind == "cpu" and not index or kind == "cuda" and (not index or index.isdigit()):
        return value
    raise argparse.ArgumentTypeError(f"{value!r} is not cpu, cuda or cuda:N")
