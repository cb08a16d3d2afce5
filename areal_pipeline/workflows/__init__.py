"""Agent workflows: one file each, each a class with one `arun_episode(engine, data) -> list[Trajectory]`."""

from __future__ import annotations

from typing import Any

def build_workflow(cfg, tokenizer, reward_pool) -> Any:
    """The workflow named by `cfg.rollout.workflow`, wired to its reward and generation settings."""
    from areal_pipeline.rewards import math_reward
    from areal_pipeline.workflows.rlvr import RLVRWorkflow

    workflows = {"rlvr": lambda: RLVRWorkflow(math_reward, cfg.rollout.gconfig, tokenizer, reward_pool)}
    name = cfg.rollout.workflow
    if name not in workflows:
        raise ValueError(f"unknown workflow '{name}'; valid: {', '.join(sorted(workflows))}")
    return workflows[name]()
