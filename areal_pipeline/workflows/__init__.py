"""Rollout workflows: one file each, each a class of the `RolloutWorkflow` protocol (protocol.py), named by
`rollout.workflow`: a name registered in `WORKFLOWS`, or a class of the user's own as "module:MyWorkflow" or
"path/to/file.py:MyWorkflow" (loaded by `user_code.load_attr`). Nothing here imports a workflow's module until its
name is looked up. The run assembly (areal_pipeline/run_spec.py) turns a run's `rollout.workflow` into its class, once,
with its `rollout.agent` section, reward function and tools, and builds the workflow from them.
"""

from __future__ import annotations

import dataclasses

from areal_pipeline.user_code import load_registered

WORKFLOWS: dict[str, str] = {
    "rlvr": "areal_pipeline.workflows.rlvr:RLVRWorkflow",
    "reflection": "areal_pipeline.workflows.reflection:ReflectionWorkflow",
    "multi_turn": "areal_pipeline.workflows.multi_turn:MultiTurnWorkflow",
    "search_agent": "areal_pipeline.workflows.search_agent:SearchAgentWorkflow",
    "openai_agent": "areal_pipeline.workflows.openai_agent:OpenAIAgentWorkflow",
    "grid_world": "areal_pipeline.workflows.grid_world:GridWorldWorkflow",
}


def workflow_class(name: str) -> type:
    """The class `rollout.workflow` names. ValueError, naming the valid names, when it names none."""
    cls = load_registered(name, WORKFLOWS, "rollout.workflow", "workflow", "Class",
                          "areal_pipeline/workflows/protocol.py")
    missing = [attr for attr in ("from_config", "arun_episode") if not callable(getattr(cls, attr, None))]
    if missing:
        raise ValueError(f"rollout.workflow={name!r}: {getattr(cls, '__name__', cls)} is not a workflow class (it has "
                         f"no {' or '.join(missing)}; see areal_pipeline/workflows/protocol.py)")
    config_class = getattr(cls, "config_class", None)
    if config_class is not None and not (isinstance(config_class, type) and dataclasses.is_dataclass(config_class)):
        raise ValueError(f"rollout.workflow={name!r}: {cls.__name__}.config_class must be a dataclass or None")
    return cls


def is_builtin(name: str) -> bool:
    return name in WORKFLOWS
