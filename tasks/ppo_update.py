from prefect import task

from tasks import registry


@task(name="ppo_update", retries=1, retry_delay_seconds=5, retry_condition_fn=registry.retry_while_running,
      persist_result=True, result_serializer="json",
      cache_key_fn=registry.output_cache_key(lambda p, k: p.paths.update(k)))
def ppo_update(run_id: str, k: int) -> dict:
    """Trainer version k - 1 -> k. On a retry (or a restarted trainer) the trainer is first brought back to
    version k - 1 from the newest checkpoint plus replayed updates."""
    return registry.run_node("ppo_update", run_id, k, limit_s=4 * 3600)
