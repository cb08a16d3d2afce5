"""Evaluation: pass@1 of a policy on the test split, during a run (the `evaluate` node) or of a checkpoint."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from areal_pipeline.checksums import has_checksums, verify_checksums
from areal_pipeline.config import ExperimentConfig
from areal_pipeline.run_dir import RunPaths
from areal_pipeline.utils import run_async


def evaluate_policy(cfg: ExperimentConfig, engine_factory, records: list[dict], tokenizer, reward_pool,
                    tool_kwargs: dict) -> dict[str, Any]:
    """pass@1 (greedy, one sample per prompt) and mean reward on `records`."""
    import dataclasses

    from areal_pipeline.rollout.executor import run_episodes
    from areal_pipeline.workflows import build_workflow

    records = records[: cfg.eval_max_prompts] if cfg.eval_max_prompts else records
    greedy = dataclasses.replace(cfg.rollout.gconfig, n_samples=1, greedy=True)
    eval_cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, gconfig=greedy))
    workflow = build_workflow(eval_cfg, tokenizer, reward_pool, **tool_kwargs)
    started = time.perf_counter()

    async def run():
        async with engine_factory() as engine:
            return await run_episodes(workflow, engine, records,
                                      max_concurrent_rollouts=cfg.rollout.max_concurrent_rollouts, progress=False)
    trajectories = run_async(run())
    n = max(1, len(trajectories))
    return {
        "num_prompts": len(records),
        "pass_at_1": sum(t.reward >= 1.0 for t in trajectories) / n,
        "reward_mean": sum(t.reward for t in trajectories) / n,
        "response_length": sum(t.num_generated for t in trajectories) / n,
        "seconds": time.perf_counter() - started,
        "samples": [{"prompt": next((m["content"] for m in t.messages if m["role"] == "user"), ""),
                     "completion": t.text, "reward": t.reward} for t in trajectories[:4]],
    }


def resolve_checkpoint(cfg: ExperimentConfig, checkpoint: str) -> Path:
    """A servable model directory, checked by `verify_model_dir`: "latest" (the run's newest checkpoint), a
    checkpoint directory, or an HF model directory."""
    if checkpoint == "latest":
        saved = RunPaths(cfg.run_dir).saved_checkpoints()
        if not saved:
            raise FileNotFoundError(f"run '{cfg.run_id}' has no checkpoint yet in {cfg.run_dir / 'checkpoints'}")
        return verify_model_dir(RunPaths(cfg.run_dir).checkpoint(saved[-1]) / "model")
    path = Path(checkpoint)
    if (path / "model" / "config.json").is_file():
        return verify_model_dir(path / "model")
    if (path / "config.json").is_file():
        return verify_model_dir(path)
    raise FileNotFoundError(f"{checkpoint} is neither a checkpoint directory (with model/) nor a model directory")


def verify_model_dir(model_dir: Path) -> Path:
    """`model_dir`, once its files match the checksums.json of the run checkpoint it belongs to (IntegrityError
    names the first file that does not, or the missing manifest). A model directory that is no run checkpoint's
    (a user's own model) has no checksums and is taken as it is."""
    checkpoint = Path(model_dir).parent
    if has_checksums(checkpoint) or (checkpoint / "trainer_state.json").is_file():
        verify_checksums(checkpoint, under=Path(model_dir).name)
    return Path(model_dir)


def evaluate_checkpoint(cfg: ExperimentConfig, checkpoint: str | Path) -> dict[str, Any]:
    """Serve `checkpoint` (as `resolve_checkpoint` takes it, and checked there) on fresh inference servers and
    score it on the test split; the record names the model directory served (`model`)."""
    import dataclasses

    model_dir = resolve_checkpoint(cfg, str(checkpoint))
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(model_dir)))
    from areal_pipeline.pipeline import Pipeline

    pipeline = Pipeline(cfg, log_dir=cfg.run_dir / "logs" / "evaluate")  # apart from a live train run's logs
    try:
        pipeline.services.start_tools()
        pipeline.services.start_inference()
        return {"model": str(model_dir), **evaluate_policy(
            cfg, pipeline._engine, pipeline.records(cfg.dataset.test_split), pipeline.tokenizer, pipeline.reward_pool,
            pipeline._tool_kwargs())}
    finally:
        pipeline.close()
        pipeline.services.stop()
