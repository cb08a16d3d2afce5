"""The configuration's sections for the services a run talks to outside itself: the experiment trackers beside
Prefect and the LLM judge of `rollout.group_reward: judge`; part of the schema (schema.py), with each field's
documentation beside it."""

from __future__ import annotations

from dataclasses import dataclass, field

@dataclass
class WandbConfig:
    """Weights & Biases (pip install 'areal-pipeline[wandb]'): each iteration's metrics and the run's config."""

    enabled: bool = False  # send the run to W&B
    project: str = "areal-pipeline"  # the W&B project the run goes to
    entity: str = ""  # the W&B team or user; empty: your default entity
    # online: to the W&B server (log in first: `wandb login`) | offline: only to files, `wandb sync <dir>` uploads
    # them later | disabled: nothing written
    mode: str = "online"
    dir: str = ""  # where W&B keeps its files (<dir>/wandb/); empty: $WANDB_DIR, else the run directory
    tags: list[str] = field(default_factory=list)  # the W&B run's tags (the run id is always one)

    @property
    def active(self) -> bool:
        """Whether the run sends anything to W&B."""
        return self.enabled and self.mode != "disabled"


@dataclass
class MlflowConfig:
    """MLflow (pip install 'areal-pipeline[mlflow]'): each iteration's metrics, the config as params."""

    enabled: bool = False  # send the run to MLflow
    # The tracking server, e.g. http://127.0.0.1:5000; empty: $MLFLOW_TRACKING_URI, else MLflow's default
    tracking_uri: str = ""
    experiment: str = "areal-pipeline"  # the MLflow experiment (created when missing); a run is found by its run id


@dataclass
class TrackersConfig:
    """The experiment trackers the run's metrics also go to, besides Prefect's artifacts (docs/trackers.md). A
    tracker that cannot be reached is warned about and left out; the run goes on."""

    tensorboard: bool = False  # write <run_dir>/tensorboard (needs the tensorboard package)
    wandb: WandbConfig = field(default_factory=WandbConfig)  # Weights & Biases
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)  # an MLflow tracking server
    timeout: float = 30.0  # seconds one call of a tracker may take before the tracker is left out of the run


@dataclass
class JudgeConfig:
    """The LLM judge of `rollout.group_reward: judge` (areal_pipeline/rewards/judge.py, docs/judge.md): one call per
    prompt scores its whole group, each answer in [0, 1], relative to the others."""

    # The judge's OpenAI-compatible endpoint, up to /v1 (e.g. http://127.0.0.1:8000/v1, https://api.openai.com/v1);
    # needed with rollout.group_reward=judge unless the run serves its judge (serve)
    base_url: str = ""
    model: str = ""  # the judge model's name at the endpoint (the requests' `model` field)
    # The run serves its judge itself (rewards/local_judge.py): the project's server on the CPU, on model_path,
    # started and stopped with the run; base_url stays empty
    serve: bool = False
    model_path: str = ""  # the judge model the run serves (a Hugging Face directory or hub id); needed with serve
    context_length: int = 4096  # the served judge's longest prompt + answer, in tokens (at most the model's own)
    # The NAME of the environment variable holding the endpoint's API key (never the key itself); empty: no key
    api_key_env: str = ""
    temperature: float = 0.0  # sampling temperature of the judge's answers (0: its most likely scores)
    max_tokens: int = 256  # most tokens of one judge answer (the scores JSON)
    timeout: float = 120.0  # seconds one judge call may take
    # A call that fails transiently (no connection, a timeout, 429, 5xx, an answer that is no valid scores JSON) is
    # made again up to this many times, after retry_delay seconds doubling (a 429's Retry-After where longer)
    retries: int = 4
    retry_delay: float = 1.0  # seconds before a judge call's first retry, doubling with each retry after it
    include_reference: bool = True  # show the judge the data set's reference answer, where there is one
    # The Prefect global concurrency limit every run and sweep on one Prefect server shares around judge calls
    # (created when missing); empty: "judge-<endpoint host>"
    limit_name: str = ""
    max_concurrency: int = 4  # judge calls in flight at once under that limit (its slots when it is created)
    slot_timeout: float = 1800.0  # seconds a judge call may wait for a slot of that limit before it fails
    # the endpoint's prices in US dollars per million tokens, for the judge/cost_usd metric (0: not counted)
    prompt_price_per_mtok: float = 0.0
    completion_price_per_mtok: float = 0.0  # US dollars per million tokens the judge writes (judge/cost_usd)
    # Where judged groups are kept by content hash (a rerun or a retried node asks again for nothing); empty:
    # <output_dir>/judge_cache, shared by the runs of one output directory
    cache_dir: str = ""
