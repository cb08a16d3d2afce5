from prefect import task

from tasks import registry


@task(name="broadcast_weights", retries=2, retry_delay_seconds=[5, 30],
      retry_condition_fn=registry.retry_while_running)
def broadcast_weights(run_id: str, k: int) -> dict:
    """Pause the servers, push version k (disk or distributed), continue. Idempotent: a retry re-pushes only
    to servers not yet at version k."""
    return registry.run_node("broadcast_weights", run_id, k, limit_s=3600)
