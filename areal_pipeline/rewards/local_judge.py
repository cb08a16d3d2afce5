"""A judge the run serves itself (`judge.serve: true`): the project's inference server on the judge model, started
with the run's other services and stopped with them, asked through the same OpenAI-compatible endpoint as any judge.

    rollout.group_reward: judge
    judge: {serve: true, model_path: /models/qwen2.5-1.5b-instruct}   # a Hugging Face directory or hub id

It runs on the CPU beside a CPU run; a judge on GPUs is served by vLLM or SGLang and named by `judge.base_url`.
Like every service of the run it demands the run's token (areal_pipeline/auth.py), which the judge reward sends
(rewards/judge.py `judge`).
No judge is built in code: grading needs a model that reads instructions, which a few minutes of CPU training
do not make.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any, Iterator, Optional

SERVED_MODEL_NAME = "local-judge"  # the requests' `model` where judge.model is empty (the server serves one model)


def start_judge_server(cfg: Any, log_dir: Path, address: Optional[str] = None):
    """The judge's server, started and healthy (within inference.setup_timeout), serving `judge.model_path`
    on the CPU at `address` (host:port; None: a free port of inference.host)."""
    from areal_pipeline import auth
    from areal_pipeline.config import InferenceConfig
    from areal_pipeline.config.addresses import split_address
    from areal_pipeline.inference.launcher import LIVENESS_PATH, build_cpu_server_command
    from areal_pipeline.processes import ServerProcess
    from areal_pipeline.utils import find_free_port

    server_cfg = InferenceConfig(backend="cpu", num_servers=1, host=cfg.inference.host, device="cpu",
                                 num_threads=1, max_batch_size=cfg.judge.max_concurrency,
                                 setup_timeout=cfg.inference.setup_timeout, context_length=cfg.judge.context_length)
    auth.ensure_run_token(cfg.output_dir)  # `areal-pipeline rescore` starts it outside a run's services: the server needs one
    port = split_address(address)[1] if address else find_free_port(server_cfg.host)
    command = build_cpu_server_command(cfg.judge.model_path, server_cfg.host, port, server_cfg, cfg.seed)
    server = ServerProcess(command, f"{server_cfg.host}:{port}", Path(log_dir) / "judge-server.log",
                           kind="judge server (judge.serve)", liveness_path=LIVENESS_PATH)
    server.start()
    try:
        server.wait_healthy(server_cfg.setup_timeout)
    except BaseException:
        server.stop()
        raise
    return server


def served_judge_config(cfg: Any, address: str) -> Any:
    """The run's config with its judge section pointing at the judge server at `address` (host:port), over https
    where the run's services speak TLS; the judge built from it sends the run's token (rewards/judge.py `judge`)."""
    from areal_pipeline import auth

    judge = dataclasses.replace(cfg.judge, base_url=auth.url(address, "/v1"),
                                model=cfg.judge.model or SERVED_MODEL_NAME)
    return dataclasses.replace(cfg, judge=judge)


@contextlib.contextmanager
def judge_served(cfg: Any, log_dir: Path, needed: bool) -> Iterator[Any]:
    """For `areal-pipeline rescore`: `cfg` pointing at a judge server started for the block (and stopped after it)
    where the judge is `needed` and `judge.serve` is set; else `cfg` as it is."""
    if not (needed and cfg.judge.serve):
        yield cfg
        return
    server = start_judge_server(cfg, log_dir)
    try:
        yield served_judge_config(cfg, server.address)
    finally:
        server.stop()
