"""Evaluation of a checkpoint: served on inference servers of its own and scored on the test split (policy_eval.py
scores it; the `evaluate` node scores the run's live policy the same way)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from areal_pipeline.checksums import has_checksums, verify_checksums
from areal_pipeline.config import ExperimentConfig
from areal_pipeline.pipeline import Pipeline
from areal_pipeline.policy_eval import evaluate_policy
from areal_pipeline.run_dir import RunPaths


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
    # served as a model directory (a LoRA run's checkpoint holds its merged policy): its servers take no adapter
    lora = dataclasses.replace(cfg.trainer.lora, push="merged")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(model_dir)),
                              trainer=dataclasses.replace(cfg.trainer, lora=lora))
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
