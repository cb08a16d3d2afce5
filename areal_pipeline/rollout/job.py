"""One iteration's rollout as a self-contained job: model, dataset, servers, episodes, shards.

This is what `areal-pipeline rollout` runs; the Prefect `rollout` task calls the same pieces with servers
that live across iterations.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path
from typing import Any

from areal_pipeline.config import ExperimentConfig, save_config
from areal_pipeline.data.datasets import load_records
from areal_pipeline.inference.client import RemoteSGLangEngine
from areal_pipeline.inference.launcher import launch_servers
from areal_pipeline.model import load_tokenizer, resolve_model_path
from areal_pipeline.rewards.pool import RewardPool
from areal_pipeline.rollout.executor import rollout_to_shards, select_batch
from areal_pipeline.workflows import build_workflow


def episode_seed(seed: int, iteration: int, prompt_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}/{iteration}/{prompt_id}".encode()).digest()[:4], "little") >> 1


def rollout_dir(cfg: ExperimentConfig, iteration: int) -> Path:
    return cfg.run_dir / f"iter_{iteration}" / "rollout"


async def rollout_iteration(cfg: ExperimentConfig, addresses: list[str], iteration: int, tokenizer,
                            reward_pool: RewardPool, progress: bool = True) -> dict[str, Any]:
    records = load_records(cfg.dataset, cfg.dataset.train_split, cfg.seed)
    batch = [{**r, "sampling_seed": episode_seed(cfg.seed, iteration, r["prompt_id"])}
             for r in select_batch(records, iteration, cfg.rollout.batch_size, cfg.seed)]
    workflow = build_workflow(cfg, tokenizer, reward_pool)
    inf = cfg.inference
    async with RemoteSGLangEngine(addresses, request_timeout=inf.request_timeout,
                                  request_retries=inf.request_retries) as engine:
        return await rollout_to_shards(
            workflow, engine, batch, rollout_dir(cfg, iteration), run_id=cfg.run_id, iteration=iteration,
            max_concurrent_rollouts=cfg.rollout.max_concurrent_rollouts,
            samples_per_episode=cfg.rollout.gconfig.n_samples, rows_per_shard=cfg.rollout.shard_rows,
            progress=progress)


def run_rollout_job(cfg: ExperimentConfig, iteration: int = 0, progress: bool = True) -> dict[str, Any]:
    """Start the servers, roll out iteration `iteration`'s batch into shards, stop the servers."""
    save_config(cfg, cfg.run_dir / "config.yaml")
    model_path = resolve_model_path(cfg.model, cfg.output_dir, cfg.seed)
    tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code)
    servers = launch_servers(model_path, cfg.inference, cfg.seed, cfg.run_dir / "logs")
    try:
        with RewardPool(max_workers=cfg.rollout.reward_workers, timeout=cfg.rollout.reward_timeout) as pool:
            return asyncio.run(rollout_iteration(cfg, [s.address for s in servers], iteration, tokenizer, pool,
                                                 progress))
    finally:
        for server in servers:
            server.stop()
