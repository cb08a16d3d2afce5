"""The experiment trackers of a `train` flow run (areal_pipeline/trackers/): started with the Prefect flow run's
URL, which each stores with its run (W&B config and notes, an MLflow tag), and each tracker's run published back
as a Prefect link artifact `<run>-<tracker>-run`, so each side links to the other."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from prefect import runtime
from prefect.artifacts import create_link_artifact

from areal_pipeline.config import to_dict
from areal_pipeline.trackers import Trackers
from flows.artifacts import artifact_key

TITLES = {"tensorboard": "TensorBoard log directory", "wandb": "Weights & Biases run", "mlflow": "MLflow run"}


def prefect_flow_run_url() -> Optional[str]:
    """The Prefect UI's page of the flow run this is called in; None outside one, or with no UI URL known."""
    url = runtime.flow_run.ui_url
    return url if url and url.startswith(("http://", "https://")) else None


def start(run: Any) -> Optional[Trackers]:
    """Start the run's enabled trackers (None when none is): they are `run.trackers` for `_report` and the end."""
    cfg = run.pipeline.cfg
    trackers = Trackers.of(cfg)
    if not trackers.active:
        return None
    url = prefect_flow_run_url()
    where = trackers.start(cfg.run_id, to_dict(cfg), {"prefect": url} if url else {})
    for name, place in where.items():
        if place.startswith(("http://", "https://")):
            link = place
        elif Path(place).is_dir():  # an offline W&B run, TensorBoard's log directory
            link = Path(place).resolve().as_uri()
        else:  # an MLflow store without a server (sqlite:, file:): no page to link
            continue
        create_link_artifact(key=artifact_key(cfg.run_id, f"{name}-run"), link=link,
                             link_text=f"{TITLES.get(name, name)} of {cfg.run_id}",
                             description=f"Run {cfg.run_id}'s metrics and config in {TITLES.get(name, name)}")
    run.trackers = trackers
    return trackers


def log(run: Any, record: Optional[dict[str, Any]]) -> None:
    if run.trackers is not None and record is not None:
        run.trackers.log(record)


def finish(run: Any, status: str) -> None:
    """`status`: completed | failed | cancelled."""
    if run.trackers is not None:
        run.trackers.finish(status)
