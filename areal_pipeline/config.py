"""Experiment configuration: dataclasses loaded from YAML, with dotted command-line overrides.

    cfg = load_config("configs/tiny_cpu.yaml", ["rollout.n_samples=4", "seed=3"])

An unknown key anywhere (file or override) is an error that names the closest valid keys, so a
typo never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf


class ConfigError(ValueError):
    pass


@dataclass
class ModelConfig:
    # A Hugging Face hub id or local directory. Empty means the embedded tiny model, built once
    # from `tiny` below into `<output_dir>/_models/`.
    path: str = ""
    dtype: str = "float32"
    trust_remote_code: bool = False
    tiny: "TinyModelConfig" = field(default_factory=lambda: TinyModelConfig())


@dataclass
class TinyModelConfig:
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 1024
    # Warm start ("pretraining") on the arithmetic train split, so that RL starts from a base model that
    # answers in the right format but is often wrong. 0 steps: random weights (what the unit tests use).
    pretrain_steps: int = 0
    pretrain_batch_size: int = 32
    pretrain_lr: float = 3e-3
    # Share of pretraining answers written one too high: a habit the base model picks up (greedy answers
    # are mostly wrong, sampled ones right about 1 - this share of the time) and RL has to unlearn.
    pretrain_off_by_one: float = 0.7


@dataclass
class DatasetConfig:
    # arithmetic (generated), gsm8k, search_qa
    name: str = "arithmetic"
    # A local jsonl file / directory, or a hub id ("openai/gsm8k"). Empty: the built-in source.
    path: str = ""
    train_split: str = "train"
    test_split: str = "test"
    max_train_size: Optional[int] = None
    max_test_size: Optional[int] = None
    system_prompt: str = ""
    # arithmetic generator
    arithmetic_train_size: int = 2000
    arithmetic_test_size: int = 200
    arithmetic_max_operand: int = 9
    arithmetic_operators: list[str] = field(default_factory=lambda: ["+"])


@dataclass
class SGLangConfig:
    """Flags for `python -m sglang.launch_server`, used when inference.backend == "sglang"."""

    tp_size: int = 1
    dp_size: int = 1
    mem_fraction_static: float = 0.8
    context_length: Optional[int] = None
    dtype: str = "bfloat16"
    disable_radix_cache: bool = False
    enable_metrics: bool = False
    log_level: str = "warning"
    extra_args: list[str] = field(default_factory=list)


@dataclass
class InferenceConfig:
    backend: str = "cpu"  # cpu | sglang
    num_servers: int = 1
    host: str = "127.0.0.1"
    base_port: int = 0  # 0: pick free ports
    setup_timeout: float = 300.0
    request_timeout: float = 3600.0
    request_retries: int = 3
    # CPU server
    max_batch_size: int = 128
    context_length: int = 1024
    num_threads: int = 0  # 0: torch default
    sglang: SGLangConfig = field(default_factory=SGLangConfig)


@dataclass
class GenerationConfig:
    n_samples: int = 4
    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    greedy: bool = False


@dataclass
class RetrievalConfig:
    """The search agent's local retrieval server (`areal-pipeline retrieval-server`)."""

    corpus: str = ""  # jsonl with id, title, contents; empty: the generated knowledge base
    retriever: str = "bm25"  # bm25 | dense
    embedding_model: str = ""  # a local sentence-embedding model directory, for retriever=dense
    index_dir: str = ""  # empty: <output_dir>/_indexes/<corpus digest>
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port
    topk: int = 3
    max_topk: int = 50
    max_query_chars: int = 2000
    request_retries: int = 3
    setup_timeout: float = 120.0


@dataclass
class AgentConfig:
    """Settings of the multi-turn and tool-using workflows (ignored by single-turn rlvr)."""

    max_turns: int = 2
    turn_discount: float = 0.9  # reflection: final reward x turn_discount per extra turn
    turn_level_discount: float = 0.9  # multi_turn: per-turn rewards discounted backwards over turns
    reward_bias: float = 0.0  # multi_turn per-turn reward: ((success - 0.5) * 2 - bias) * scaling
    reward_scaling: float = 1.0
    max_tokens: int = 1024  # search agent: budget of the whole episode (prompt + all turns)
    reward: str = "f1"  # search agent: f1 | exact_match
    retrieval: RetrievalConfig = field(default_factory=RetrievalConfig)


@dataclass
class RolloutConfig:
    workflow: str = "rlvr"
    batch_size: int = 16  # prompts per iteration
    # eta: iteration k's episodes may be generated while the policy is at version >= k - 1 - eta, i.e. during
    # the updates of up to eta earlier iterations. 0: synchronous.
    max_head_offpolicyness: int = 0
    max_concurrent_rollouts: int = 128
    reward_timeout: float = 5.0
    reward_workers: int = 1
    shard_rows: int = 256
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)


@dataclass
class NormConfig:
    """Normalisation of rewards or advantages; a level of "none" switches that part off."""

    mean_level: str = "group"  # group | batch | none
    std_level: str = "group"  # group | batch | none
    mean_leave_one_out: bool = False  # RLOO: each sample's baseline excludes itself
    eps: float = 1e-5


@dataclass
class PPOConfig:
    """The algorithm: reward shaping, advantages and the policy loss (AReaL's PPOActorConfig names)."""

    loss: str = "ppo"  # ppo | reinforce
    ppo_n_minibatches: int = 1
    eps_clip: float = 0.2
    eps_clip_higher: Optional[float] = None
    c_clip: Optional[float] = None  # dual clip (> 1)
    importance_sampling_level: str = "token"  # token | sequence (GSPO)
    use_decoupled_loss: Optional[bool] = None  # None: on in asynchronous mode (max_head_offpolicyness > 0)
    behav_imp_weight_cap: Optional[float] = None
    recompute_logprob: bool = False
    reward_bias: float = 0.0
    reward_scaling: float = 1.0
    reward_clip: float = 20.0
    reward_norm: NormConfig = field(default_factory=NormConfig)
    adv_norm: NormConfig = field(default_factory=lambda: NormConfig(mean_level="batch", std_level="batch"))
    kl_ctl: float = 0.0
    kl_estimator: str = "k1"  # k1 | k2 | k3
    discount: float = 1.0
    gae_lambda: float = 1.0
    mask_no_eos_with_zero: bool = False


@dataclass
class OptimizerConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    gradient_clipping: float = 1.0
    lr_scheduler_type: str = "constant"  # constant | linear | cosine
    warmup_steps_proportion: float = 0.0
    min_lr_ratio: float = 0.0


@dataclass
class TrainerConfig:
    nproc: int = 1  # ranks per node (torchrun --nproc-per-node)
    nnodes: int = 1
    torchrun_args: list[str] = field(default_factory=list)  # e.g. rendezvous options for multi-node
    backend: str = "auto"  # auto: nccl on CUDA, gloo on CPU
    device: str = "auto"  # auto | cpu | cuda
    param_dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU (mixed precision, fp32 master weights)
    # torch threads per rank; 0: torch's default, or in asynchronous mode on CPU the cores the CPU inference
    # servers leave (at least 1)
    num_threads: int = 0
    mb_max_tokens: int = 8192  # micro-batch token budget for packed sequences
    pack_sequences: bool = True  # false: one padded row per sequence (the slower baseline)
    # Sequences that start alike (a GRPO group's prompt) run their common prefix once, where it is at least as
    # long as each sequence's rest; the same logprobs and gradients for fewer forward tokens (sdpa/eager attention)
    share_prefix: bool = True
    gradient_checkpointing: bool = False
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    weight_sync: str = "disk"  # disk | distributed
    setup_timeout: float = 300.0
    command_timeout: float = 3600.0


@dataclass
class ExperimentConfig:
    run_id: str = "tiny-cpu"
    output_dir: str = "runs"
    seed: int = 1
    model: ModelConfig = field(default_factory=ModelConfig)
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    total_iterations: int = 10
    save_freq: int = 1  # checkpoint every N iterations (and after the last)
    keep_checkpoints: int = 2  # newest K kept
    eval_freq: int = 0  # pass@1 on the test split every N iterations (and after the last); 0: off
    eval_max_prompts: int = 0  # 0: the whole test split
    tensorboard: bool = False  # also write <run_dir>/tensorboard (needs the tensorboard package)

    def __post_init__(self) -> None:
        if self.ppo.use_decoupled_loss is None:
            self.ppo.use_decoupled_loss = self.rollout.max_head_offpolicyness > 0

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run_id


def _valid_keys(schema: type, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(schema):
        name = prefix + f.name
        keys.append(name)
        sub = _dataclass_type(schema, f)
        if sub is not None:
            keys.extend(_valid_keys(sub, name + "."))
    return keys


def _dataclass_type(schema: type, f: dataclasses.Field) -> Optional[type]:
    hints = _type_hints(schema)
    t = hints.get(f.name)
    return t if dataclasses.is_dataclass(t) else None


_HINTS: dict[type, dict[str, Any]] = {}


def _type_hints(schema: type) -> dict[str, Any]:
    if schema not in _HINTS:
        import typing

        _HINTS[schema] = typing.get_type_hints(schema)
    return _HINTS[schema]


def _check_keys(data: Any, schema: type, where: str, prefix: str = "") -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: '{prefix.rstrip('.') or '<root>'}' must be a mapping, got {data!r}")
    names = {f.name: f for f in dataclasses.fields(schema)}
    for key, value in data.items():
        dotted = prefix + str(key)
        if key not in names:
            valid = _valid_keys(schema, prefix)
            close = difflib.get_close_matches(dotted, valid, n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}?" if close else ""
            siblings = ", ".join(prefix + f for f in names)
            raise ConfigError(
                f"{where}: unknown config key '{dotted}'. {hint} Valid keys here: {siblings}".replace("  ", " ")
            )
        sub = _dataclass_type(schema, names[key])
        if sub is not None and value is not None:
            _check_keys(value, sub, where, dotted + ".")


def load_config(
    path: str | os.PathLike | None = None,
    overrides: list[str] | None = None,
    schema: type = ExperimentConfig,
) -> Any:
    """Build a `schema` instance from defaults <- YAML file <- `key=value` overrides."""
    merged = OmegaConf.structured(schema)
    layers = []
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        file_cfg = OmegaConf.load(path)
        data = OmegaConf.to_container(file_cfg, resolve=False) or {}
        _check_keys(data, schema, str(path))
        layers.append(file_cfg)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        override = OmegaConf.from_dotlist([item])
        _check_keys(OmegaConf.to_container(override), schema, f"override '{item}'")
        layers.append(override)
    try:
        merged = OmegaConf.merge(merged, *layers)
        return OmegaConf.to_object(merged)
    except Exception as e:  # omegaconf's type errors: keep its message, name our context
        raise ConfigError(f"invalid config value: {e}") from e


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Any, path: str | os.PathLike) -> Path:
    """Write the resolved config (atomically) so a run can always be reproduced from its directory."""
    from areal_pipeline.utils import atomic_write_text

    return atomic_write_text(Path(path), to_yaml(cfg))
