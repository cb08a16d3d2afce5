"""Rollout workflows: one file each, each a class of the `RolloutWorkflow` protocol (protocol.py), named by
`rollout.workflow`: a name registered in `WORKFLOWS`, or a class of the user's own as "module:MyWorkflow" or
"path/to/file.py:MyWorkflow" (loaded by `user_code.load_attr`). Nothing here imports a workflow's module until its
name is looked up.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from areal_pipeline.rewards.pool import RewardReference
from areal_pipeline.user_code import is_reference, load_attr, load_registered

WORKFLOWS: dict[str, str] = {
    "rlvr": "areal_pipeline.workflows.rlvr:RLVRWorkflow",
    "reflection": "areal_pipeline.workflows.reflection:ReflectionWorkflow",
    "multi_turn": "areal_pipeline.workflows.multi_turn:MultiTurnWorkflow",
    "search_agent": "areal_pipeline.workflows.search_agent:SearchAgentWorkflow",
    "openai_agent": "areal_pipeline.workflows.openai_agent:OpenAIAgentWorkflow",
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


def agent_section_class(name: str) -> type:
    """The dataclass `rollout.agent` is an instance of when `rollout.workflow` is `name`. For the package's own
    workflows: `AgentConfig`, which has every built-in workflow's keys (each workflow reads its own; a key of another
    built-in workflow is accepted, as it was before each workflow declared its section). For a workflow of the
    user's own: its `config_class`, and no key at all when it declares none."""
    if is_builtin(name):
        from areal_pipeline.workflows.agent_config import AgentConfig

        return AgentConfig
    return getattr(workflow_class(name), "config_class", None) or NoAgentConfig


@dataclasses.dataclass
class NoAgentConfig:
    """rollout.agent of a workflow that declares no config_class: no keys."""


def pooled_reward_function(cfg) -> Optional[Callable[[str, Any], float]]:
    """The reward function the selected workflow runs in the reward pool (its `reward_function`, "module:attr"),
    or None when it scores in process (the search agent) or is scored by the agent (openai_agent)."""
    cls = workflow_class(cfg.rollout.workflow)
    reference = getattr(cls, "reward_function", None)
    if reference is None:
        return None
    if not is_reference(reference):  # the form is checked here; whether it loads, in the pool's workers
        load_attr(reference, f"{cls.__name__}.reward_function", "function")
    return RewardReference(reference, f"{cls.__name__}.reward_function")


def required_tools(cfg) -> tuple[str, ...]:
    """The tool servers the selected workflow declares (its `tools`), for `Services.start_tools`."""
    return tuple(getattr(workflow_class(cfg.rollout.workflow), "tools", ()))


def build_workflow(cfg, tokenizer, reward_pool, *, tool_addresses: Optional[dict[str, str]] = None) -> Any:
    """The workflow named by `cfg.rollout.workflow`, built by its `from_config`.

    `tool_addresses` names running tool servers, e.g. {"retrieval": "127.0.0.1:8000"} for the search agent
    (see `Services.start_tools`); without one the search agent retrieves in process, from the same index.
    """
    return workflow_class(cfg.rollout.workflow).from_config(
        cfg, tokenizer, reward_pool, reward_fn=pooled_reward_function(cfg), tool_addresses=dict(tool_addresses or {}))
