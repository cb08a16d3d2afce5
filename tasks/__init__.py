"""Prefect tasks: one per DAG node, each a thin wrapper over `areal_pipeline.pipeline.Pipeline`.

Tasks run in the flow's process and find the run's live `Pipeline` (its servers and trainer) in
`tasks.registry` by run id; their parameters are small (run id, iteration) and their results are small JSON
records, persisted so that a retried or rerun flow shows finished nodes as Cached.
"""

from tasks.nodes import advantages, broadcast_weights, checkpoint, evaluate, ppo_update, rollout
from tasks.setup import prepare_dataset, start_inference_servers, start_tool_servers, start_trainer

__all__ = ["advantages", "broadcast_weights", "checkpoint", "evaluate", "ppo_update", "prepare_dataset", "rollout",
           "start_inference_servers", "start_tool_servers", "start_trainer"]
