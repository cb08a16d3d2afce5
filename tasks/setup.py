"""Setup nodes of the train flow: data, inference servers, trainer, tool servers.

They start processes of this flow run's own, so they run on every attempt of it: a retried train run (the UI's
Retry, `prefect flow-run retry`) keeps its flow run id, and Prefect's default cache (inputs, code and run id)
would hand back the first attempt's results, naming servers that died with it. Retries: transient faults only."""

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks import runs
from tasks.nodes import retry_while_running

SETUP = dict(retries=1, retry_delay_seconds=5, retry_condition_fn=retry_while_running,
             cache_policy=NO_CACHE)


@task(name="prepare_dataset", **SETUP)
def prepare_dataset(run_id: str) -> dict:
    return runs.get(run_id).pipeline.prepare_dataset()


@task(name="start_inference_servers", **SETUP)
def start_inference_servers(run_id: str) -> list[str]:
    return runs.get(run_id).pipeline.services.start_inference()


@task(name="start_trainer", **SETUP)
def start_trainer(run_id: str) -> str:
    return runs.get(run_id).pipeline.services.start_trainer()


@task(name="start_tool_servers", **SETUP)
def start_tool_servers(run_id: str) -> dict[str, str]:
    return runs.get(run_id).pipeline.services.start_tools()
