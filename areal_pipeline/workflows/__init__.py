"""Agent workflows: one file each, each a class with one `arun_episode(engine, data) -> list[Trajectory]`."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

WORKFLOWS = ("rlvr", "reflection", "multi_turn", "remax", "search_agent", "openai_agent")


def build_workflow(cfg, tokenizer, reward_pool, *, tool_addresses: Optional[dict[str, str]] = None) -> Any:
    """The workflow named by `cfg.rollout.workflow`, wired to its reward and generation settings.

    `tool_addresses` names running tool servers, e.g. {"retrieval": "127.0.0.1:8000"} for the search agent
    (see `tools.retrieval_server.launch_retrieval_server`); without one the search agent retrieves in
    process, from the same index.
    """
    name = cfg.rollout.workflow
    reward_fn = pooled_reward_function(cfg)
    g, agent = cfg.rollout.gconfig, cfg.rollout.agent
    if name == "rlvr":
        from areal_pipeline.workflows.rlvr import RLVRWorkflow

        return RLVRWorkflow(reward_fn, g, tokenizer, reward_pool)
    if name == "reflection":
        from areal_pipeline.workflows.reflection import ReflectionWorkflow

        return ReflectionWorkflow(reward_fn, g, tokenizer, reward_pool, max_turns=agent.max_turns,
                                  turn_discount=agent.turn_discount)
    if name == "multi_turn":
        from areal_pipeline.workflows.multi_turn import MultiTurnWorkflow

        return MultiTurnWorkflow(reward_fn, g, tokenizer, reward_pool, max_turns=agent.max_turns,
                                 turn_level_discount=agent.turn_level_discount, reward_bias=agent.reward_bias,
                                 reward_scaling=agent.reward_scaling, wrong_message=agent.wrong_message,
                                 correct_message=agent.correct_message, stop_on_success=agent.stop_on_success)
    if name == "remax":
        from areal_pipeline.workflows.remax import ReMaxWorkflow

        return ReMaxWorkflow(reward_fn, g, tokenizer, reward_pool)
    if name == "openai_agent":
        from areal_pipeline.workflows.openai_agent import OpenAIAgentWorkflow, load_agent

        return OpenAIAgentWorkflow(load_agent(agent.entry), g, tokenizer, entry=agent.entry,
                                   turn_discount=agent.turn_discount, export_style=agent.export_style)
    return _search_agent(cfg, tokenizer, (tool_addresses or {}).get("retrieval"))


def pooled_reward_function(cfg) -> Optional[Callable[[str, Any], float]]:
    """The reward function the workflow runs in the reward pool (None: the search agent scores in process, an
    OpenAI agent scores itself)."""
    if cfg.rollout.workflow not in WORKFLOWS:
        raise ValueError(f"unknown workflow '{cfg.rollout.workflow}'; valid: {', '.join(WORKFLOWS)}")
    if cfg.rollout.workflow in ("search_agent", "openai_agent"):
        return None
    from areal_pipeline.rewards import math_reward

    return math_reward


def _search_agent(cfg, tokenizer, address: Optional[str]) -> Any:
    from areal_pipeline.rewards import exact_match_reward, f1_reward
    from areal_pipeline.tools.retrieval_client import LocalRetrievalClient, RetrievalClient
    from areal_pipeline.workflows.search_agent import SearchAgentWorkflow

    agent, r = cfg.rollout.agent, cfg.rollout.agent.retrieval
    rewards = {"f1": f1_reward, "exact_match": exact_match_reward}
    if agent.reward not in rewards:
        raise ValueError(f"unknown search agent reward '{agent.reward}'; valid: {', '.join(rewards)}")
    address = r.address or address  # a server already running (retrieval.address), else the run's own
    if address:
        retrieval = RetrievalClient(address, retries=r.request_retries)
    else:
        from areal_pipeline.tools.retrieval_server import RetrievalService

        retrieval = LocalRetrievalClient(RetrievalService.from_config(r, Path(cfg.output_dir) / "_indexes"))
    return SearchAgentWorkflow(rewards[agent.reward], cfg.rollout.gconfig, tokenizer, retrieval,
                               max_turns=agent.max_turns, max_tokens=agent.max_tokens, topk=r.topk,
                               max_query_chars=r.max_query_chars, prompt=agent.prompt, information=agent.information)
