"""Prefect tasks: one per DAG node (tasks/nodes.py, from the step table `areal_pipeline.steps.STEPS`), and the
set-up nodes of the train flow (tasks/setup.py).

A node's parameters are the run's context (its directory and its services' addresses), the iteration and the
outputs of the nodes before it: it runs with the run's live pipeline in the flow's process, and attached to the
run's services anywhere else (`tasks.runs.pipeline_for`). Results are small JSON records, persisted so that a
retried or rerun flow shows finished nodes as Cached. The set-up nodes start the run's services, in the flow's
process, found there by run id.
"""

from tasks.nodes import NODES, call_node
from tasks.setup import prepare_dataset, start_inference_servers, start_tool_servers, start_trainer

__all__ = ["NODES", "call_node", "prepare_dataset", "start_inference_servers", "start_tool_servers",
           "start_trainer"]
