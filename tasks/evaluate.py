from typing import Optional

from prefect import task

from tasks import registry


@task(name="evaluate", retries=1, retry_delay_seconds=5, retry_condition_fn=registry.retry_while_running,
      persist_result=True, result_serializer="json",
      cache_key_fn=registry.output_cache_key(lambda p, k: p.paths.evaluation(k)))
def evaluate(run_id: str, k: int) -> Optional[dict]:
    """pass@1 of version k on the test split, every eval_freq iterations."""
    return registry.run_node("evaluate", run_id, k, limit_s=4 * 3600)
