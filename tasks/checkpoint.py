from prefect import task

from tasks import registry


@task(name="checkpoint", retries=1, retry_delay_seconds=5, retry_condition_fn=registry.retry_while_running)
def checkpoint(run_id: str, k: int) -> dict:
    """`checkpoints/step_<k>/` every save_freq iterations (temp dir, then rename); keeps the newest K."""
    return registry.run_node("checkpoint", run_id, k, limit_s=3600)
