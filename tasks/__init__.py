"""Prefect tasks: one per DAG node (tasks/nodes.py, from the step table `areal_pipeline.steps.STEPS`), and the
set-up nodes of the train flow (tasks/setup.py).

Tasks run in the flow's process and find the run's live pipeline (its servers and trainer) in `tasks.runs` by run
id; their parameters are the run id, the iteration and the outputs of the nodes before them, and their results
are small JSON records, persisted so that a retried or rerun flow shows finished nodes as Cached.
"""

from tasks.nodes import NODES, call_node
from tasks.setup import prepare_dataset, start_inference_servers, start_tool_servers, start_trainer

__all__ = ["NODES", "call_node", "prepare_dataset", "start_inference_servers", "start_tool_servers",
           "start_trainer"]
