"""`rollout.agent` when a workflow of the package runs: the sections the built-in workflows declare, in one.

Each built-in workflow declares its own section (ReflectionConfig beside ReflectionWorkflow, and so on) and reads
only it; `AgentConfig` is an instance of each of them, so `cfg.rollout.agent` is the selected workflow's section
whichever built-in one runs. A key of another built-in workflow stays accepted (and checked), as it was when they
shared one section. A workflow of the user's own gets its own `config_class` alone (run_spec.section_class).
"""

from __future__ import annotations

from dataclasses import dataclass

from areal_pipeline.workflows.grid_world import GridWorldConfig
from areal_pipeline.workflows.multi_turn import MultiTurnConfig
from areal_pipeline.workflows.openai_agent import OpenAIAgentConfig
from areal_pipeline.workflows.reflection import ReflectionConfig
from areal_pipeline.workflows.search_agent import SearchAgentConfig


@dataclass
class AgentConfig(GridWorldConfig, OpenAIAgentConfig, SearchAgentConfig, MultiTurnConfig, ReflectionConfig):
    """Settings of the multi-turn and tool-using workflows (rlvr takes none)."""

    # Fields come in the reverse order of the bases (reflection's first), as one section listed them before.
    # A key two workflows declare (max_turns, turn_discount) has one default, which both must agree on.
