"""Scoring a policy: pass@1 and mean reward on the test split's prompts, greedy, one sample each. The `evaluate` node
runs it on the run's servers; `evaluation.evaluate_checkpoint` on servers of a checkpoint's own."""

from __future__ import annotations

import time
from typing import Any

from areal_pipeline.config import ExperimentConfig
from areal_pipeline.run_spec import RunSpec, assemble, build_workflow
from areal_pipeline.utils import run_async


def evaluate_policy(run: RunSpec | ExperimentConfig, engine_factory, records: list[dict], tokenizer, reward_pool,
                    tool_kwargs: dict, per_prompt: bool = False) -> dict[str, Any]:
    """pass@1 (greedy, one sample per prompt) and mean reward on `records`, with the run's workflow (a config in
    place of a RunSpec is assembled first); `per_prompt`: also each prompt's reward and answer (`per_prompt`,
    prompt id -> {"reward", "completion"}), what a paired comparison of two policies needs."""
    import dataclasses

    from areal_pipeline.rollout.executor import play_batch
    from areal_pipeline.rollout.failures import FailurePolicy

    if not isinstance(run, RunSpec):
        run = assemble(run)
    cfg = run.cfg
    records = records[: cfg.eval_max_prompts] if cfg.eval_max_prompts else records
    greedy = dataclasses.replace(cfg.rollout.gconfig, n_samples=1, greedy=True)
    eval_cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, gconfig=greedy))
    workflow = build_workflow(run, tokenizer, reward_pool, cfg=eval_cfg, **tool_kwargs)
    started = time.perf_counter()

    # An episode that fails is played again as in training (same seed, rollout.episode_retries); one that fails for
    # good fails the evaluation, naming the cause: a score over fewer prompts would not compare with the others.
    policy = dataclasses.replace(FailurePolicy.of(cfg.rollout), on_failure="fail")

    async def run():
        async with engine_factory() as engine:
            return await play_batch(workflow, engine, dict(enumerate(records)), n_samples=1, policy=policy,
                                    max_concurrent_rollouts=cfg.rollout.max_concurrent_rollouts, progress=False)
    groups = run_async(run())
    trajectories = [t for group in groups for t in group.trajectories]
    n = max(1, len(trajectories))
    scores = {}
    if per_prompt:  # a prompt's one greedy episode may make several trajectories (turns): the last one's reward
        for group in groups:
            for t in group.trajectories:
                scores[str(group.prompt_id)] = {"reward": float(t.reward), "completion": t.text}
    return {
        "num_prompts": len(records),
        "pass_at_1": sum(t.reward >= 1.0 for t in trajectories) / n,
        "reward_mean": sum(t.reward for t in trajectories) / n,
        "response_length": sum(t.num_generated for t in trajectories) / n,
        "seconds": time.perf_counter() - started,
        "samples": [{"prompt": next((m["content"] for m in t.messages if m["role"] == "user"), ""),
                     "completion": t.text, "reward": t.reward} for t in trajectories[:4]],
        **({"per_prompt": scores} if per_prompt else {}),
    }
