"""Setup nodes of the train flow: data, inference servers, trainer, tool servers."""

from prefect import task

from tasks import registry


@task(name="prepare_dataset", retries=1, retry_delay_seconds=5)
def prepare_dataset(run_id: str) -> dict:
    return registry.get(run_id).prepare_dataset()


@task(name="start_inference_servers", retries=1, retry_delay_seconds=5)
def start_inference_servers(run_id: str) -> list[str]:
    return registry.get(run_id).services.start_inference()


@task(name="start_trainer", retries=1, retry_delay_seconds=5)
def start_trainer(run_id: str) -> str:
    return registry.get(run_id).services.start_trainer()


@task(name="start_tool_servers", retries=1, retry_delay_seconds=5)
def start_tool_servers(run_id: str) -> dict[str, str]:
    return registry.get(run_id).services.start_tools()
