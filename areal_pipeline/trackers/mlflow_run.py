"""MLflow: one MLflow run per project run in the configured experiment, found again by its tag `areal.run_id`, so
that continuing the run (same run id) continues the same MLflow run. The config goes in as params (dotted keys),
the Prefect flow run's URL as the tag `prefect.flow_run_url`."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from typing import Any, Iterator

RUN_ID_TAG = "areal.run_id"
PREFECT_URL_TAG = "prefect.flow_run_url"
STATUSES = {"completed": "FINISHED", "failed": "FAILED", "cancelled": "KILLED"}
# MLflow's limits: params per log_batch call, characters of a param's value
PARAMS_PER_BATCH, PARAM_VALUE_CHARS = 100, 6000


def flatten(config: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in config.items():
        if isinstance(value, dict) and value:
            yield from flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """Where the MLflow UI shows a run (for a server; a local store has no URL, the same form names the run)."""
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def check_reachable(tracking_uri: str, timeout: float) -> None:
    """A tracking server that does not answer fails at once: MLflow's client would retry for minutes."""
    if not tracking_uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(f"{tracking_uri.rstrip('/')}/health", timeout=timeout):
            pass
    except urllib.error.HTTPError:
        pass  # it answers (a server behind a proxy may not serve /health)
    except OSError as e:
        raise ConnectionError(f"MLflow tracking server {tracking_uri} does not answer: {e}") from None


class MlflowTracker:
    name = "mlflow"

    def __init__(self, cfg: Any, timeout: float):
        self.cfg, self.timeout = cfg, timeout
        self.client = self.run_id = None

    def start(self, run_id: str, config: dict[str, Any], links: dict[str, str]) -> str:
        import mlflow
        from mlflow import MlflowClient
        from mlflow.entities import Param

        uri = self.cfg.tracking_uri or mlflow.get_tracking_uri()
        check_reachable(uri, min(self.timeout, 10.0))
        self.client = client = MlflowClient(uri)
        experiment = client.get_experiment_by_name(self.cfg.experiment)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(self.cfg.experiment)
        quoted = run_id.replace("'", "\\'")
        found = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_ID_TAG}` = '{quoted}'",
                                   max_results=1)
        if found:
            run = found[0]
            client.update_run(run.info.run_id, status="RUNNING")
        else:
            run = client.create_run(experiment_id, run_name=run_id, tags={RUN_ID_TAG: run_id})
        self.run_id = run.info.run_id
        for name, url in links.items():
            client.set_tag(self.run_id, PREFECT_URL_TAG if name == "prefect" else f"{name}.url", url)
        # params cannot change once logged: a continued run (with more iterations, say) adds only new keys
        known = set(run.data.params)
        params = [Param(key, str(value)[:PARAM_VALUE_CHARS]) for key, value in flatten(config) if key not in known]
        for i in range(0, len(params), PARAMS_PER_BATCH):
            client.log_batch(self.run_id, params=params[i:i + PARAMS_PER_BATCH])
        return run_url(uri, experiment_id, self.run_id)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        client_metrics = [Metric(key, value, now, step) for key, value in metrics.items()]
        for i in range(0, len(client_metrics), 1000):  # MLflow's limit of metrics per log_batch call
            self.client.log_batch(self.run_id, metrics=client_metrics[i:i + 1000])

    def finish(self, status: str) -> None:
        if self.client is not None:
            self.client.set_terminated(self.run_id, STATUSES.get(status, "FAILED"))
