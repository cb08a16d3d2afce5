from prefect import task

from tasks import registry


@task(name="advantages", retries=1, retry_delay_seconds=5, retry_condition_fn=registry.retry_while_running,
      persist_result=True, result_serializer="json",
      cache_key_fn=registry.output_cache_key(lambda p, k: p.paths.batch(k)))
def advantages(run_id: str, k: int) -> dict:
    """Rollout shards -> batch shards with rewards, (KL penalties) and advantages."""
    return registry.run_node("advantages", run_id, k, limit_s=3600)
