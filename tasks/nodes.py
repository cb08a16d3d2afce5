"""The DAG's nodes as Prefect tasks, from one table: each node's retries, time limit and cache key.

Every node is `Pipeline.<name>(k)` of the run's live pipeline (`registry.run_node`), within its time limit.
Retries are for transient faults only, and only while the run goes on (`registry.retry_while_running`). A node
whose output is a directory of shards or a record is cached by that output (`registry.output_cache_key`): a
rerun or a retried train run shows it Cached and skips it while the output is complete and intact on disk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks import registry

HOUR = 3600


@dataclass(frozen=True)
class Node:
    name: str
    doc: str
    retries: int
    retry_delay_seconds: Any
    limit_s: float
    output: Optional[Callable[[Any, int], Any]] = None  # (pipeline, k) -> the path that caches the node


NODES = (
    Node("rollout", "Episodes of iteration k with policy k - 1 -> `iter_<k>/rollout/`. A server that died is "
         "restarted and brought to the right weights before the episodes start.",
         retries=2, retry_delay_seconds=[5, 30], limit_s=4 * HOUR, output=lambda p, k: p.paths.rollout(k)),
    Node("advantages", "Rollout shards -> batch shards with rewards, (KL penalties) and advantages.",
         retries=1, retry_delay_seconds=5, limit_s=HOUR, output=lambda p, k: p.paths.batch(k)),
    Node("ppo_update", "Trainer version k - 1 -> k. On a retry (or a restarted trainer) the trainer is first "
         "brought back to version k - 1 from the newest checkpoint plus replayed updates.",
         retries=1, retry_delay_seconds=5, limit_s=4 * HOUR, output=lambda p, k: p.paths.update(k)),
    Node("broadcast_weights", "Pause the servers, push version k (disk or distributed), continue. Idempotent: a "
         "retry re-pushes only to servers not yet at version k.",
         retries=2, retry_delay_seconds=[5, 30], limit_s=HOUR),
    Node("checkpoint", "`checkpoints/step_<k>/` every save_freq iterations (temp dir, then rename); keeps the "
         "newest K.", retries=1, retry_delay_seconds=5, limit_s=HOUR),
    Node("evaluate", "pass@1 of version k on the test split, every eval_freq iterations.",
         retries=1, retry_delay_seconds=5, limit_s=4 * HOUR, output=lambda p, k: p.paths.evaluation(k)),
)


def _node_task(node: Node):
    def run(run_id: str, k: int) -> Any:
        return registry.run_node(node.name, run_id, k, limit_s=node.limit_s)

    run.__name__ = run.__qualname__ = node.name
    run.__doc__ = node.doc
    # a node without an output on disk runs every time it is called (it is idempotent): Prefect's default cache
    # key (inputs and code) would be the same for every node made here
    cached = (dict(persist_result=True, result_serializer="json", cache_key_fn=registry.output_cache_key(node.output))
              if node.output is not None else dict(cache_policy=NO_CACHE))
    # named by iteration: a flow run of several iterations holds several runs of each node
    return task(run, name=node.name, task_run_name=f"{node.name}-{{k}}", retries=node.retries, retry_delay_seconds=node.retry_delay_seconds,
                retry_condition_fn=registry.retry_while_running, **cached)


rollout, advantages, ppo_update, broadcast_weights, checkpoint, evaluate = map(_node_task, NODES)
