from prefect import task

from tasks import registry


@task(name="checkpoint", retries=1, retry_delay_seconds=5, retry_condition_fn=registry.retry_while_running,
      timeout_seconds=3600)
def checkpoint(run_id: str, k: int) -> dict:
    """`checkpoints/step_<k>/` every save_freq iterations (temp dir, then rename); keeps the newest K."""
    return registry.get(run_id).checkpoint(k)
