from prefect import task

from tasks import registry


@task(name="ppo_update", retries=1, retry_delay_seconds=5, retry_condition_fn=registry.retry_while_running,
      timeout_seconds=4 * 3600, persist_result=True, result_serializer="json",
      cache_key_fn=registry.output_cache_key(lambda p, k: p.paths.update(k)))
def ppo_update(run_id: str, k: int) -> dict:
    """Trainer version k - 1 -> k. On a retry (or a restarted trainer) the trainer is first brought back to
    version k - 1 from the newest checkpoint plus replayed updates."""
    return registry.get(run_id).ppo_update(k)
