from prefect import task

from tasks import registry


@task(name="rollout", retries=2, retry_delay_seconds=[5, 30], retry_condition_fn=registry.retry_while_running,
      persist_result=True, result_serializer="json",
      cache_key_fn=registry.output_cache_key(lambda p, k: p.paths.rollout(k)))
def rollout(run_id: str, k: int) -> dict:
    """Episodes of iteration k with policy k - 1 -> `iter_<k>/rollout/`. A server that died is restarted and
    brought to the right weights before the episodes start."""
    return registry.run_node("rollout", run_id, k, limit_s=4 * 3600)
