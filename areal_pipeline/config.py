"""Experiment configuration: dataclasses loaded from YAML, with dotted command-line overrides.

    cfg = load_config("configs/tiny_cpu.yaml", ["rollout.n_samples=4", "seed=3"])

An unknown key anywhere (file or override) is an error that names the closest valid keys, so a
typo never silently falls back to a default. A bad value (a count of 0, a negative learning rate, a NaN, a
local path that does not exist) is an error naming its dotted key, what it is and what is allowed, raised by
`load_config` before any process starts: the rules are the tables FIELD_RULES and CROSS_RULES at the end.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import yaml
from omegaconf import OmegaConf

from areal_pipeline.errors import PermanentError
from areal_pipeline.warm_start import CURRICULA


class ConfigError(PermanentError, ValueError):
    pass


@dataclass
class ModelConfig:
    # A Hugging Face hub id or local directory. Empty means the embedded tiny model, built once
    # from `tiny` below into `<output_dir>/_models/`.
    path: str = ""
    dtype: str = "float32"  # the weights' dtype as loaded (the trainer's own precision: trainer.param_dtype)
    trust_remote_code: bool = False  # let transformers run the model repository's own code (custom architectures)
    # the embedded model's shape and warm start, used when path is empty
    tiny: "TinyModelConfig" = field(default_factory=lambda: TinyModelConfig())


@dataclass
class TinyModelConfig:
    hidden_size: int = 128  # width of the embedded Qwen2-architecture model
    intermediate_size: int = 384  # width of its MLP layers
    num_hidden_layers: int = 4  # its transformer layers
    num_attention_heads: int = 4  # its query heads (must divide hidden_size)
    num_key_value_heads: int = 2  # its key/value heads, grouped-query attention (must divide num_attention_heads)
    max_position_embeddings: int = 1024  # the longest sequence it takes (prompt and generation)
    # Warm start ("pretraining") on the arithmetic train split, so that RL starts from a base model that
    # answers in the right format but is often wrong. 0 steps: random weights (what the unit tests use).
    pretrain_steps: int = 0
    # The warm start's curriculum (areal_pipeline/warm_start/): each task's own format and habits.
    pretrain_task: str = "arithmetic"
    pretrain_batch_size: int = 32  # sequences per warm-start step
    pretrain_lr: float = 3e-3  # the warm start's learning rate (AdamW)
    # Share of pretraining answers written one too high: a habit the base model picks up (greedy answers
    # are mostly wrong, sampled ones right about 1 - this share of the time) and RL has to unlearn.
    pretrain_off_by_one: float = 0.7


@dataclass
class DatasetConfig:
    # arithmetic (generated), gsm8k, search_qa
    name: str = "arithmetic"
    # A local jsonl file / directory, or a hub id ("openai/gsm8k"). Empty: the built-in source.
    path: str = ""
    train_split: str = "train"  # the split rollouts draw their prompts from
    test_split: str = "test"  # the split evaluation (pass@1) scores
    max_train_size: Optional[int] = None  # the first N records of the train split (None: all)
    max_test_size: Optional[int] = None  # the first N records of the test split (None: all)
    system_prompt: str = ""  # a system message put before every question (empty: none)
    # arithmetic generator: questions in the train split
    arithmetic_train_size: int = 2000
    arithmetic_test_size: int = 200  # arithmetic generator: questions in the test split
    arithmetic_max_operand: int = 9  # arithmetic generator: operands are drawn from 0..this
    arithmetic_operators: list[str] = field(default_factory=lambda: ["+"])  # arithmetic generator: + - *


@dataclass
class SGLangConfig:
    """Flags for `python -m sglang.launch_server`, used when inference.backend == "sglang". Supported SGLang releases:
    0.5.10.post1 (AReaL's pin) to 0.5.23 (docs/engines.md)."""

    # The python of SGLang's own environment (a venv with `pip install sglang==0.5.10.post1`, say): sglang pins its
    # own torch, transformers and openai, so it cannot be installed beside this project. Empty: this interpreter
    python: str = ""
    tp_size: int = 1  # tensor parallelism: GPUs one server's model is split over (--tp-size)
    dp_size: int = 1  # data-parallel replicas inside one server (--dp-size); a server takes tp_size x dp_size GPUs
    # The server's share of its GPUs' memory (weights + KV cache); the project's own server on CUDA caps its
    # allocator at it too when it shares its GPU with the trainer (trainer.colocate)
    mem_fraction_static: float = 0.8
    context_length: Optional[int] = None  # longest prompt + generation the server takes (None: the model's)
    # the served weights' dtype (--dtype: auto, half, float16, bfloat16, float, float32), also the wire dtype of
    # distributed weight sync (auto: the model's)
    dtype: str = "bfloat16"
    # --enable-deterministic-inference: without it SGLang ignores `sampling_seed`, which the rollout sends so that a
    # rerun samples the same tokens. It costs throughput (batch-invariant kernels, a slower sampler) and refuses
    # min_p > 0; false trades reproducible reruns for speed
    deterministic_inference: bool = True
    disable_radix_cache: bool = False  # no prefix cache (multi-turn episodes then prefill every turn again)
    enable_metrics: bool = False  # SGLang's Prometheus metrics endpoint
    log_level: str = "warning"  # SGLang's log level (its log: <run_dir>/logs/inference-server-<i>.log)
    extra_args: list[str] = field(default_factory=list)  # more launch_server flags, passed as they are


@dataclass
class VLLMConfig:
    """How `python -m vllm.entrypoints.openai.api_server` is launched, used when inference.backend == "vllm"."""

    # The interpreter of vLLM's own environment (vLLM pins its own torch). Empty: the project's .venv-vllm/bin/python
    # where it exists, else this interpreter
    python: str = ""
    dtype: str = "auto"  # the served weights' dtype (--dtype); auto: the checkpoint's
    max_model_len: Optional[int] = None  # longest prompt + generation (--max-model-len); None: the model's
    enforce_eager: bool = True  # no torch.compile / graph capture (a faster start, slower decoding)
    extra_args: list[str] = field(default_factory=list)  # more api_server flags, passed as they are
    # More environment variables of the server, e.g. {"VLLM_CPU_KVCACHE_SPACE": "4"} (GiB of KV cache on a CPU)
    env: dict[str, str] = field(default_factory=dict)
    # Send each episode's sampling seed (reruns sample the same tokens where the batch is the same). Off by default:
    # vLLM 0.32's CPU engine dies ("CPU Generator does not use offset") when a seeded request's prefill is split
    # across steps, which a rollout's burst of requests does; on GPUs it can be turned on
    seeded_sampling: bool = False


@dataclass
class InferenceConfig:
    # cpu: the project's own server (transformers; on the CPU or, with device=cuda, a GPU) | sglang: SGLang's |
    # vllm: vLLM's OpenAI-compatible server (its own environment: inference.vllm.python)
    backend: str = "cpu"
    num_servers: int = 1  # servers launched, data parallel (round robin; a trajectory sticks to its server)
    host: str = "127.0.0.1"  # the address launched servers listen on
    base_port: int = 0  # 0: pick free ports
    setup_timeout: float = 300.0  # seconds a server has to answer /health after its launch
    request_timeout: float = 3600.0  # seconds one generation request may take
    request_retries: int = 3  # retries of a request that failed to connect or got a 5xx, then an error
    # the project's server: requests decoded together at most (more wait their turn)
    max_batch_size: int = 128
    context_length: int = 1024  # the project's server: longest prompt + generation it takes
    num_threads: int = 0  # the project's server's torch threads; 0: torch default
    max_body_bytes: int = 64 << 20  # largest request body the CPU server takes (413 beyond)
    device: str = "cpu"  # the project's own server: cpu | cuda (one GPU a server, from `gpus`)
    dtype: str = "float32"  # the project's own server's weights
    # GPU indices (as this process numbers them, i.e. within CUDA_VISIBLE_DEVICES) of the launched servers: server
    # i takes the i-th tp_size*dp_size of them (sglang) or the i-th one (device=cuda). Empty: automatic (the
    # first ones the trainer leaves, or the trainer's own with trainer.colocate)
    gpus: list[int] = field(default_factory=list)
    # Servers already running (SGLang, an SGLang router, or this project's), as host:port: the run uses them,
    # launches none and never stops them. Weights reach them by trainer.weight_sync: disk (trainer.weights_dir must
    # be a path they read at the same name) or distributed (trainer.weight_sync_master_address must reach them)
    addresses: list[str] = field(default_factory=list)
    sglang: SGLangConfig = field(default_factory=SGLangConfig)  # launch flags of SGLang servers (backend=sglang)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # launch flags of vLLM servers (backend=vllm)
    # After every weight update, check on each server that it serves the trainer's weights: the logprobs it gives a
    # short fixed probe against the trainer's. A mismatch is an error, never a run on stale weights
    verify_weights: bool = True
    # Largest mean |served - trainer| probe logprob that passes; 0: by precision (float32 tight, 16 bits looser)
    verify_tolerance: float = 0.0


@dataclass
class GenerationConfig:
    n_samples: int = 4  # episodes per prompt: the group GRPO normalises rewards within
    max_new_tokens: int = 32  # tokens one generation may add (a multi-turn episode makes one per turn)
    # sampling temperature; the trainer recomputes logprobs at the same one
    temperature: float = 1.0
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens with this much probability (1: off)
    top_k: int = -1  # sample among the k most likely tokens (-1: off)
    stop: list[str] = field(default_factory=list)  # strings that end a generation
    stop_token_ids: list[int] = field(default_factory=list)  # token ids that end a generation, besides EOS
    greedy: bool = False  # argmax decoding (evaluation sets it, with one sample per prompt)


@dataclass
class RetrievalConfig:
    """The search agent's local retrieval server (`areal-pipeline retrieval-server`)."""

    corpus: str = ""  # jsonl with id, title, contents; empty: the generated knowledge base
    # host:port of a retrieval server already running (e.g. ASearcher's Wiki-18 server, same /retrieve API):
    # the run uses it rather than starting one (then corpus, retriever and the server settings below are unused)
    address: str = ""
    retriever: str = "bm25"  # bm25 | dense
    embedding_model: str = ""  # a local sentence-embedding model directory, for retriever=dense
    index_dir: str = ""  # empty: <output_dir>/_indexes/<corpus digest>
    host: str = "127.0.0.1"  # the interface the run's retrieval server listens on
    port: int = 0  # 0: a free port
    topk: int = 3  # documents a search returns to the agent
    max_topk: int = 50  # the most documents the server returns for one query (a larger topk is refused)
    max_query_chars: int = 2000  # a query is cut to this many characters before it is searched
    # A request is searched in one go by the server's single search worker: max_queries and max_body_bytes bound
    # how long it holds it (413 beyond). Queries in one request at most
    max_queries: int = 256
    max_body_bytes: int = 1 << 20  # the largest request body the server reads (413 beyond)
    request_retries: int = 3  # retries of a failed search before the episode ends with reward 0
    setup_timeout: float = 120.0  # seconds the run's server may take to build its index and answer /health


def _builtin_agent_section() -> Any:
    from areal_pipeline.workflows.agent_config import AgentConfig

    return AgentConfig()


def _agent_section_class() -> type:
    from areal_pipeline.workflows.agent_config import AgentConfig

    return AgentConfig


@dataclass
class RolloutConfig:
    # the agent that plays the episodes: rlvr | reflection | multi_turn | search_agent | openai_agent, or a
    # class of your own as "module:MyWorkflow" / "path/to/file.py:MyWorkflow" (areal_pipeline/workflows/protocol.py)
    workflow: str = "rlvr"
    batch_size: int = 16  # prompts per iteration
    # eta: iteration k's episodes may be generated while the policy is at version >= k - 1 - eta, i.e. during
    # the updates of up to eta earlier iterations. 0: synchronous.
    max_head_offpolicyness: int = 0
    max_concurrent_rollouts: int = 128  # episodes in flight at once (each a group of gconfig.n_samples)
    # seconds a reward function may take on one answer before it scores 0 (its worker is killed and replaced)
    reward_timeout: float = 5.0
    reward_workers: int = 1  # processes of the reward pool that score answers
    shard_rows: int = 256  # trajectories per Parquet shard of a rollout
    # sampling of the episodes' generations (evaluation: greedy, one sample)
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    # the selected workflow's own section (its config_class): the package's workflows share one, AgentConfig
    # (workflows/agent_config.py); a workflow of your own gets its keys here
    agent: Any = field(default_factory=_builtin_agent_section, metadata={"section": _agent_section_class})


@dataclass
class NormConfig:
    """Normalisation of rewards or advantages; a level of "none" switches that part off."""

    mean_level: str = "group"  # group | batch | none
    std_level: str = "group"  # group | batch | none
    mean_leave_one_out: bool = False  # RLOO: each sample's baseline excludes itself
    eps: float = 1e-5  # added to the standard deviation before dividing by it


@dataclass
class PPOConfig:
    """The algorithm: reward shaping, advantages and the policy loss (AReaL's PPOActorConfig names)."""

    loss: str = "ppo"  # ppo | reinforce | "module:attr", a loss builder of your own (training/loss_registry.py)
    # rewards -> advantages: grpo | remax | "module:attr", an advantage builder of your own
    # (training/advantage_registry.py)
    advantage: str = "grpo"
    ppo_n_minibatches: int = 1  # an iteration's batch is split into this many minibatches, an optimizer step each
    eps_clip: float = 0.2  # the ratio is clipped to [1 - eps_clip, 1 + eps_clip]
    eps_clip_higher: Optional[float] = None  # the upper clip, 1 + eps_clip_higher, when it differs (DAPO's clip-higher)
    c_clip: Optional[float] = None  # dual clip (> 1)
    importance_sampling_level: str = "token"  # token | sequence (GSPO)
    use_decoupled_loss: Optional[bool] = None  # None: on in asynchronous mode (max_head_offpolicyness > 0)
    # decoupled loss: tokens whose behaviour importance weight (proximal / behaviour policy) passes this are dropped
    behav_imp_weight_cap: Optional[float] = None
    # recompute the "old" logprobs with the trainer before the update instead of the servers' (a rerun after a
    # crash then reaches the same weights bit for bit)
    recompute_logprob: bool = False
    reward_bias: float = 0.0  # rewards become clamp((r + reward_bias) * reward_scaling, -reward_clip, reward_clip)
    reward_scaling: float = 1.0  # rewards become clamp((r + reward_bias) * reward_scaling, -reward_clip, reward_clip)
    reward_clip: float = 20.0  # rewards become clamp((r + reward_bias) * reward_scaling, -reward_clip, reward_clip)
    reward_norm: NormConfig = field(default_factory=NormConfig)  # normalisation of the rewards (per GRPO group)
    # normalisation of the advantages (over the batch)
    adv_norm: NormConfig = field(default_factory=lambda: NormConfig(mean_level="batch", std_level="batch"))
    kl_ctl: float = 0.0  # KL penalty on every generated token's reward, -kl_ctl * KL(policy || reference)
    kl_estimator: str = "k1"  # k1 | k2 | k3
    discount: float = 1.0  # per-token discount of the returns (GAE's gamma)
    gae_lambda: float = 1.0  # GAE's lambda
    mask_no_eos_with_zero: bool = False  # sequences cut off before EOS get no reward (their KL penalty stays)


@dataclass
class OptimizerConfig:
    lr: float = 1e-5  # AdamW's learning rate (the peak, with a scheduler)
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.999  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's epsilon
    gradient_clipping: float = 1.0  # gradients are scaled to this global norm at most
    lr_scheduler_type: str = "constant"  # constant | linear | cosine
    warmup_steps_proportion: float = 0.0  # share of the optimizer steps that warm the learning rate up linearly
    min_lr_ratio: float = 0.0  # linear and cosine schedules decay to lr x min_lr_ratio


@dataclass
class TrainerConfig:
    nproc: int = 1  # ranks per node (torchrun --nproc-per-node)
    nnodes: int = 1  # nodes (torchrun --nnodes); more than 1 needs rendezvous options in torchrun_args
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
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, more compute
    # On CUDA, torch.compile the per-token logprob, entropy and their gradient over the vocabulary into fused
    # kernels (eager, each step is a pass over a float32 [tokens, vocab] temporary); the first update pays the
    # compilation. Ignored on the CPU
    compile: bool = True
    # torch.compile each decoder layer (its norms, rotary embedding and SwiGLU fused around the matrix products):
    # None: on CUDA only; true: on any device; false: never. The first updates pay the compilation (seconds per
    # new shape, until the compiler treats lengths as dynamic)
    compile_layers: Optional[bool] = None
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)  # AdamW and its learning-rate schedule
    # how new weights reach the servers: disk (a Hugging Face directory they load) | distributed (a broadcast
    # over a process group they join: NCCL where trainer and servers are on CUDA, gloo otherwise)
    weight_sync: str = "disk"
    # weight_sync=disk: where the trainer writes each version for the servers to load (<dir>/<run_id>/v<k>); empty:
    # <run_dir>/weights. Servers on another host need a shared path, the same on both
    weights_dir: str = ""
    # weight_sync=distributed: the address the servers reach the trainer's weight-update group at (a local master
    # binds it alone), and its port (0: a free one)
    weight_sync_master_address: str = "127.0.0.1"
    weight_sync_master_port: int = 0  # weight_sync=distributed: the group's port on that address (0: a free one)
    # weight_sync=distributed: the most MiB announced by one update call; a server allocates what it announces
    # before receiving it, so one call for a whole model would need twice its memory
    weight_sync_bucket_mb: int = 1024
    # GPU indices (as this process numbers them) of the ranks on each node, rank r on gpus[r]; empty: automatic (the
    # first ones the inference servers leave)
    gpus: list[int] = field(default_factory=list)
    # The trainer may share GPUs with the inference servers (one-GPU use): their memory is then split, the
    # servers' share inference.sglang.mem_fraction_static, each rank's memory_fraction
    colocate: bool = False
    memory_fraction: float = 1.0  # share of its GPU's memory a rank may allocate (1: no cap)
    setup_timeout: float = 300.0  # seconds the trainer has to load the model and answer after its launch
    command_timeout: float = 3600.0  # seconds one trainer command (an update, a save) may take


@dataclass
class ExperimentConfig:
    run_id: str = "tiny-cpu"  # the run's name: its directory under output_dir, and its Prefect flow runs'
    output_dir: str = "runs"  # where runs (and the embedded model and retrieval indexes they build) are kept
    seed: int = 1  # seeds the warm start, prompt order, sampling and training: a rerun repeats the run
    model: ModelConfig = field(default_factory=ModelConfig)  # the policy: a model to load, or the embedded one
    dataset: DatasetConfig = field(default_factory=DatasetConfig)  # the prompts and reference answers
    inference: InferenceConfig = field(default_factory=InferenceConfig)  # the servers that generate the episodes
    rollout: RolloutConfig = field(default_factory=RolloutConfig)  # the episodes: workflow, batch, sampling
    ppo: PPOConfig = field(default_factory=PPOConfig)  # the algorithm: rewards, advantages, loss
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # the training processes and the optimizer
    total_iterations: int = 10  # RL iterations of the run (rollout, update, weights to the servers)
    save_freq: int = 1  # checkpoint every N iterations (and after the last)
    keep_checkpoints: int = 2  # newest K kept
    eval_freq: int = 0  # pass@1 on the test split every N iterations (and after the last); 0: off
    eval_max_prompts: int = 0  # 0: the whole test split
    tensorboard: bool = False  # also write <run_dir>/tensorboard (needs the tensorboard package)
    # Iterations per Prefect flow run of the `train` flow (`<run>/iter-<k>`, or `<run>/iter-<k>..<k+n-1>`), each
    # node still a task run of its own. A flow run costs the Prefect API several synchronous calls and CPU beside
    # the nodes: worth it where an iteration takes minutes, not where it takes a fraction of a second.
    iterations_per_flow_run: int = 1

    def __post_init__(self) -> None:
        if self.ppo.use_decoupled_loss is None:
            self.ppo.use_decoupled_loss = self.rollout.max_head_offpolicyness > 0

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run_id


@dataclass(frozen=True)
class ChosenSection:
    """A section whose class depends on another value (`rollout.agent` on `rollout.workflow`), as chosen at load."""

    schema: type  # the dataclass its values load into
    owner: str  # what chose it, for messages: "workflow reflection"
    keys: tuple[str, ...]  # the keys the owner reads (a subset of schema's fields)


Chosen = dict[str, ChosenSection]  # dotted key of a section -> its chosen class


def _valid_keys(schema: type, prefix: str = "", chosen: Optional[Chosen] = None) -> list[str]:
    keys = []
    for f in dataclasses.fields(schema):
        name = prefix + f.name
        keys.append(name)
        sub = _dataclass_type(schema, f, chosen, name)
        if sub is not None:
            keys.extend(_valid_keys(sub, name + ".", chosen))
    return keys


def _dataclass_type(schema: type, f: dataclasses.Field, chosen: Optional[Chosen] = None,
                    dotted: str = "") -> Optional[type]:
    """The section class of field `f` (None: a plain value). A field typed Any whose metadata names a "section"
    (a function returning its default class) holds a section chosen at load: `chosen[dotted]` when given."""
    if chosen and dotted in chosen:
        return chosen[dotted].schema
    hints = _type_hints(schema)
    t = hints.get(f.name)
    if dataclasses.is_dataclass(t):
        return t
    section = f.metadata.get("section")
    return section() if section else None


_HINTS: dict[type, dict[str, Any]] = {}


def _type_hints(schema: type) -> dict[str, Any]:
    if schema not in _HINTS:
        import typing

        _HINTS[schema] = typing.get_type_hints(schema)
    return _HINTS[schema]


def _check_keys(data: Any, schema: type, where: str, prefix: str = "", chosen: Optional[Chosen] = None) -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: '{prefix.rstrip('.') or '<root>'}' must be a mapping, got {data!r}")
    names = {f.name: f for f in dataclasses.fields(schema)}
    for key, value in data.items():
        dotted = prefix + str(key)
        if key not in names:
            valid = _valid_keys(schema, prefix, chosen)
            close = difflib.get_close_matches(dotted, valid, n=3, cutoff=0.5)
            hint = f"did you mean {', '.join(close)}?" if close else ""
            section = (chosen or {}).get(prefix.rstrip("."))
            if section is not None:  # name the keys of what chose the section, not every key it happens to hold
                here = f"Keys of {section.owner}: {', '.join(prefix + k for k in section.keys) or 'none'}"
            else:
                here = f"Valid keys here: {', '.join(prefix + f for f in names)}"
            raise ConfigError(f"{where}: unknown config key '{dotted}'. {hint} {here}".replace("  ", " "))
        sub = _dataclass_type(schema, names[key], chosen, dotted)
        if sub is not None and value is not None:
            _check_keys(value, sub, where, dotted + ".", chosen)


def _selected_workflow(given: list[tuple[Any, str]]) -> tuple[str, str]:
    """`rollout.workflow` as the layers (data, where) set it, before they are merged, and where the last one that
    sets it comes from."""
    workflow, where = RolloutConfig.workflow, "the default"
    for data, layer in given:
        rollout = data.get("rollout") if isinstance(data, dict) else None
        if isinstance(rollout, dict) and isinstance(rollout.get("workflow"), str):
            workflow, where = rollout["workflow"], layer
    return workflow, where


def _workflow_sections(workflow: str, where: str) -> Chosen:
    """`rollout.agent`'s class for `workflow`: the selected workflow's own section (workflows.agent_section_class)."""
    from areal_pipeline.workflows import agent_section_class, workflow_class

    try:
        own = getattr(workflow_class(workflow), "config_class", None)
        schema = agent_section_class(workflow)
    except ValueError as error:
        raise ConfigError(f"{where}: rollout.workflow={workflow!r}: {error}") from None
    keys = tuple(f.name for f in dataclasses.fields(own)) if own is not None else ()
    return {"rollout.agent": ChosenSection(schema, f"workflow {workflow}", keys)}


def load_config(
    path: str | os.PathLike | None = None,
    overrides: list[str] | None = None,
    schema: type = ExperimentConfig,
) -> Any:
    """Build a `schema` instance from defaults <- YAML file <- `key=value` overrides. `rollout.agent` takes the
    section of the workflow that `rollout.workflow` names once the layers are read (workflows/__init__.py)."""
    merged = OmegaConf.structured(schema)
    layers, given = [], []  # the layers, and each one's plain data with where it came from, for key checks
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            file_cfg = OmegaConf.load(path)
        except yaml.YAMLError as e:  # the problem and its place, on one line
            raise ConfigError(f"{path} is not valid YAML: {' '.join(str(e).split())}") from None
        given.append((OmegaConf.to_container(file_cfg, resolve=False) or {}, str(path)))
        layers.append(file_cfg)
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not of the form key=value")
        override = OmegaConf.from_dotlist([item])
        given.append((OmegaConf.to_container(override), f"override '{item}'"))
        layers.append(override)
    chosen: Chosen = {}
    if schema is ExperimentConfig:
        chosen = _workflow_sections(*_selected_workflow(given))
        merged.rollout.agent = OmegaConf.structured(chosen["rollout.agent"].schema)
    for data, where in given:
        _check_keys(data, schema, where, chosen=chosen)
    try:
        merged = OmegaConf.merge(merged, *layers)
        cfg = OmegaConf.to_object(merged)
    except Exception as e:  # omegaconf's type errors: keep its message, on one line led by the key
        # (its first line: the rest repeats the key and names the dataclass)
        key, message = getattr(e, "full_key", None), str(e).splitlines()[0]
        raise ConfigError(f"{key + ': ' if key else ''}invalid config value: {message}") from e
    validate(cfg)
    return cfg


def resolve_run_config(config_path, overrides: Optional[list[str]] = None, run_id: Optional[str] = None,
                       iterations: Optional[int] = None) -> ExperimentConfig:
    """The run's config; `iterations` extends an existing run by that many iterations past its newest one."""
    from areal_pipeline.run_dir import newest_completed_iteration

    overrides = list(overrides or []) + ([f"run_id={run_id}"] if run_id else [])
    cfg = load_config(config_path, overrides)
    if iterations is not None:
        cfg.total_iterations = newest_completed_iteration(cfg.run_dir) + iterations
    return cfg


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Any, path: str | os.PathLike) -> Path:
    """Write the resolved config (atomically) so a run can always be reproduced from its directory."""
    from areal_pipeline.utils import atomic_write_text

    return atomic_write_text(Path(path), to_yaml(cfg))


# ---------------------------------------------------------------------------------------------- value rules


@dataclass(frozen=True)
class Rule:
    """What one config value must be: `allowed` tells the user, `holds` checks a value. Rules never see None:
    an Optional field's None means "off" or "automatic" and is always allowed. Every float must also be finite,
    whatever its rule."""

    allowed: str
    holds: Callable[[Any], bool]


def at_least(low: float) -> Rule:
    return Rule(f">= {low}", lambda value: value >= low)


def above(low: float) -> Rule:
    return Rule(f"> {low}", lambda value: value > low)


def within(low: float, high: float, *, open_low: bool = False, open_high: bool = False) -> Rule:
    def holds(value) -> bool:
        return (low < value if open_low else low <= value) and (value < high if open_high else value <= high)

    return Rule(f"in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}", holds)


def one_of(*choices: str) -> Rule:
    return Rule(f"one of {', '.join(choices)}", lambda value: value in choices)


def each(rule: Rule) -> Rule:
    return Rule(f"a list of values {rule.allowed}", lambda values: all(rule.holds(v) for v in values))


# A hub repo id: "name" or "namespace/name", what transformers and datasets load when it is no local path.
_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")
_ADDRESS = re.compile(r"[\w.-]+:\d{1,5}")  # a server's host:port


def looks_like_local_path(location: str) -> bool:
    """Whether a model or dataset location means a local path rather than a hub id: it starts like a path
    (/, ./, ../, ~), cannot be a hub id or names a data file, or its first part exists here ("runs/x")."""
    if location.startswith(("/", "./", "../", "~")) or location in (".", ".."):
        return True
    if not _HUB_ID.fullmatch(location) or location.endswith((".json", ".jsonl")):
        return True
    return "/" in location and Path(location.split("/")[0]).exists()


def _missing_local_path(location: str) -> bool:
    # Without this a missing directory reaches the hub as a repo id and fails there, much later and obscurely.
    return bool(location) and looks_like_local_path(location) and not Path(location).expanduser().exists()


def _holds_no_rows(location: str) -> bool:
    """An existing file with nothing but whitespace; reads only up to its first non-blank chunk."""
    path = Path(location).expanduser()
    if not location or not path.is_file():
        return False
    with open(path, "rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _local_path_or_hub_id(example: str) -> Rule:
    return Rule(f"an existing local path or a hub id such as {example} (no such file or directory here)",
                lambda location: not _missing_local_path(location))


_EXISTING_FILE = Rule("an existing file (no such file here)",
                      lambda location: not location or Path(location).expanduser().is_file())
_NOT_EMPTY = Rule("a file with rows (this one is empty)", lambda location: not _holds_no_rows(location))
_FINITE = Rule("a finite number", lambda value: True)  # the walker checks finiteness of every float
_COUNT = at_least(1)
_NON_NEGATIVE = at_least(0)


def _loss_builder_exists(name: str) -> bool:
    from areal_pipeline.training.loss_registry import LOSSES, loss_builder

    if name in LOSSES:  # the package's own: known without importing the trainer's modules here
        return True
    try:
        loss_builder(name)
    except ValueError:
        return False
    return True


_LOSS = Rule("ppo, reinforce, or 'module:attr' naming an importable loss builder (training/loss_registry.py)",
             _loss_builder_exists)


def _advantage_builder_exists(name: str) -> bool:
    from areal_pipeline.training.advantage_registry import advantage_builder

    try:
        advantage_builder(name)
    except ValueError:
        return False
    return True


_ADVANTAGE = Rule("grpo, remax, or 'module:attr' naming an importable advantage builder "
                  "(training/advantage_registry.py)", _advantage_builder_exists)


def _workflow_loads(name: str) -> bool:
    from areal_pipeline.workflows import workflow_class

    try:
        workflow_class(name)
    except ValueError:
        return False
    return True


_WORKFLOW = Rule("rlvr, reflection, multi_turn, search_agent, openai_agent, or 'module:Class' / "
                 "'path/to/file.py:Class' naming a workflow class of your own (workflows/protocol.py)",
                 _workflow_loads)
_POSITIVE = above(0)
_FRACTION = within(0, 1)
_PORT = within(0, 65535)  # 0: a free port
_HOST_PORT = Rule("empty or host:port", lambda value: not value or bool(_ADDRESS.fullmatch(value)))
_ADAM_BETA = within(0, 1, open_high=True)
_GPU_LIST = Rule("a list of distinct GPU indices >= 0",
                 lambda ids: all(type(i) is int and i >= 0 for i in ids) and len(set(ids)) == len(ids))
_ADDRESSES = Rule("a list of distinct host:port addresses",
                  lambda addresses: all(isinstance(a, str) and _ADDRESS.fullmatch(a) for a in addresses)
                  and len(set(addresses)) == len(addresses))
_HOST = Rule("a host name or IP address", lambda host: bool(re.fullmatch(r"[\w.:-]+", host)))
_NORM_LEVEL = one_of("group", "batch", "none")
_DTYPES = ("float32", "bfloat16", "float16")  # model.DTYPES
_EXECUTABLE_OR_EMPTY = Rule("empty or an executable file (e.g. /opt/sglang-env/bin/python)",
                            lambda path: not path or (os.path.isfile(os.path.expanduser(path))
                                                      and os.access(os.path.expanduser(path), os.X_OK)))

_VLLM_PYTHON = Rule("empty (.venv-vllm/bin/python, else this interpreter) or an existing executable file",
                    lambda path: path == "" or (os.path.isfile(os.path.expanduser(path))
                                                and os.access(os.path.expanduser(path), os.X_OK)))
_ENV_VARS = Rule("a mapping of environment variable names to string values",
                 lambda env: all(isinstance(k, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)
                                 and isinstance(v, str) for k, v in env.items()))

# Per section type, its fields' rules (a tuple: checked in order, the first one broken is reported). Keyed by
# type rather than dotted key: a section used twice (ppo.reward_norm, ppo.adv_norm) has one set of rules.
FIELD_RULES: dict[type, dict[str, Rule | tuple[Rule, ...]]] = {
    ExperimentConfig: {"seed": _NON_NEGATIVE, "total_iterations": _COUNT, "save_freq": _COUNT,
                       "keep_checkpoints": _COUNT, "eval_freq": _NON_NEGATIVE, "eval_max_prompts": _NON_NEGATIVE,
                       "iterations_per_flow_run": _COUNT},
    ModelConfig: {"path": _local_path_or_hub_id("Qwen/Qwen2.5-1.5B-Instruct"), "dtype": one_of(*_DTYPES)},
    TinyModelConfig: {"hidden_size": _COUNT, "intermediate_size": _COUNT, "num_hidden_layers": _COUNT,
                      "num_attention_heads": _COUNT, "num_key_value_heads": _COUNT, "max_position_embeddings": _COUNT,
                      "pretrain_steps": _NON_NEGATIVE, "pretrain_batch_size": _COUNT, "pretrain_lr": _POSITIVE,
                      "pretrain_off_by_one": _FRACTION, "pretrain_task": one_of(*CURRICULA)},
    DatasetConfig: {"path": (_local_path_or_hub_id("openai/gsm8k"), _NOT_EMPTY), "max_train_size": _COUNT,
                    "max_test_size": _NON_NEGATIVE, "arithmetic_train_size": _COUNT,
                    "arithmetic_test_size": _NON_NEGATIVE, "arithmetic_max_operand": _NON_NEGATIVE},
    SGLangConfig: {"tp_size": _COUNT, "dp_size": _COUNT, "mem_fraction_static": within(0, 1, open_low=True),
                   "context_length": _COUNT, "python": _EXECUTABLE_OR_EMPTY,
                   "dtype": one_of("auto", "half", "float16", "bfloat16", "float", "float32")},
    VLLMConfig: {"python": _VLLM_PYTHON, "dtype": one_of("auto", *_DTYPES), "max_model_len": _COUNT,
                 "env": _ENV_VARS},
    InferenceConfig: {"backend": one_of("cpu", "sglang", "vllm"), "num_servers": _COUNT, "base_port": _PORT,
                      "verify_tolerance": _NON_NEGATIVE,
                      "setup_timeout": _POSITIVE, "request_timeout": _POSITIVE, "request_retries": _NON_NEGATIVE,
                      "max_batch_size": _COUNT, "context_length": _COUNT, "num_threads": _NON_NEGATIVE,
                      "max_body_bytes": _COUNT, "device": one_of("cpu", "cuda"), "dtype": one_of(*_DTYPES),
                      "gpus": _GPU_LIST, "addresses": _ADDRESSES},
    GenerationConfig: {"n_samples": _COUNT, "max_new_tokens": _COUNT, "temperature": _NON_NEGATIVE,
                       "top_p": within(0, 1, open_low=True),
                       "top_k": Rule("-1 (no top-k) or >= 1", lambda value: value == -1 or value >= 1),
                       "stop_token_ids": each(_NON_NEGATIVE)},
    RetrievalConfig: {"corpus": (_EXISTING_FILE, _NOT_EMPTY),
                      "embedding_model": _local_path_or_hub_id("sentence-transformers/all-MiniLM-L6-v2"),
                      "port": _PORT, "topk": _COUNT, "max_topk": _COUNT, "max_query_chars": _COUNT,
                      "max_queries": _COUNT, "max_body_bytes": _COUNT, "request_retries": _NON_NEGATIVE,
                      "setup_timeout": _POSITIVE,
                      "address": _HOST_PORT},
    # rollout.agent: each workflow's section carries its own rules (`field_rules`, see field_rules_of)
    RolloutConfig: {"workflow": _WORKFLOW, "batch_size": _COUNT, "max_head_offpolicyness": _NON_NEGATIVE,
                    "max_concurrent_rollouts": _COUNT, "reward_timeout": _POSITIVE, "reward_workers": _COUNT,
                    "shard_rows": _COUNT},
    NormConfig: {"mean_level": _NORM_LEVEL, "std_level": _NORM_LEVEL, "eps": _POSITIVE},
    PPOConfig: {"loss": _LOSS, "advantage": _ADVANTAGE, "ppo_n_minibatches": _COUNT, "eps_clip": within(0, 1, open_low=True),
                "eps_clip_higher": _POSITIVE, "c_clip": above(1), "importance_sampling_level": one_of("token", "sequence"),
                "behav_imp_weight_cap": at_least(1), "reward_bias": _FINITE, "reward_scaling": _FINITE,
                "reward_clip": _POSITIVE, "kl_ctl": _NON_NEGATIVE, "kl_estimator": one_of("k1", "k2", "k3"),
                "discount": _FRACTION, "gae_lambda": _FRACTION},
    OptimizerConfig: {"lr": _POSITIVE, "weight_decay": _NON_NEGATIVE, "beta1": _ADAM_BETA, "beta2": _ADAM_BETA,
                      "eps": _POSITIVE, "gradient_clipping": _POSITIVE,
                      "lr_scheduler_type": one_of("constant", "linear", "cosine"),
                      "warmup_steps_proportion": _FRACTION, "min_lr_ratio": _FRACTION},
    TrainerConfig: {"nproc": _COUNT, "nnodes": _COUNT, "backend": one_of("auto", "nccl", "gloo"),
                    "param_dtype": one_of("auto", *_DTYPES),
                    "num_threads": _NON_NEGATIVE, "mb_max_tokens": _COUNT,
                    "weight_sync": one_of("disk", "distributed"), "setup_timeout": _POSITIVE,
                    "command_timeout": _POSITIVE, "gpus": _GPU_LIST, "memory_fraction": within(0, 1, open_low=True),
                    "weight_sync_master_address": _HOST, "weight_sync_master_port": _PORT,
                    "weight_sync_bucket_mb": _COUNT},
}

Key = Callable[[str], str]  # a field name (or dotted path) within a section -> its dotted key in the config


def _attention_heads_divide(tiny: TinyModelConfig, key: Key) -> Iterator[str]:
    if tiny.hidden_size % tiny.num_attention_heads:
        yield (f"{key('hidden_size')}={tiny.hidden_size}: must be a multiple of "
               f"{key('num_attention_heads')}={tiny.num_attention_heads}")
    if tiny.num_attention_heads % tiny.num_key_value_heads:
        yield (f"{key('num_attention_heads')}={tiny.num_attention_heads}: must be a multiple of "
               f"{key('num_key_value_heads')}={tiny.num_key_value_heads}")


def _default_topk_within_max(retrieval: RetrievalConfig, key: Key) -> Iterator[str]:
    if retrieval.topk > retrieval.max_topk:
        yield f"{key('topk')}={retrieval.topk}: must be <= {key('max_topk')}={retrieval.max_topk}"


def _generation_fits_context(cfg: ExperimentConfig, key: Key) -> Iterator[str]:
    if cfg.inference.backend == "cpu" and cfg.rollout.gconfig.max_new_tokens >= cfg.inference.context_length:
        yield (f"{key('rollout.gconfig.max_new_tokens')}={cfg.rollout.gconfig.max_new_tokens}: must be < "
               f"{key('inference.context_length')}={cfg.inference.context_length} (the prompt needs room too)")
    limit = cfg.inference.vllm.max_model_len
    if cfg.inference.backend == "vllm" and limit is not None and cfg.rollout.gconfig.max_new_tokens >= limit:
        yield (f"{key('rollout.gconfig.max_new_tokens')}={cfg.rollout.gconfig.max_new_tokens}: must be < "
               f"{key('inference.vllm.max_model_len')}={limit} (the prompt needs room too)")


# Head sizes vLLM's CPU attention computes (vllm/v1/attention/backends/cpu_attn.py, 0.32); it loads a model with
# another one and fails on its first request
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def _vllm_serves_the_embedded_model(cfg: ExperimentConfig, key: Key) -> Iterator[str]:
    inf, tiny = cfg.inference, cfg.model.tiny
    if inf.backend != "vllm" or inf.device != "cpu" or cfg.model.path or tiny.hidden_size % tiny.num_attention_heads:
        return
    head = tiny.hidden_size // tiny.num_attention_heads
    if head not in VLLM_CPU_HEAD_SIZES:
        yield (f"{key('model.tiny.num_attention_heads')}={tiny.num_attention_heads}: the embedded model's head size "
               f"({key('model.tiny.hidden_size')}={tiny.hidden_size} / {tiny.num_attention_heads} = {head}) must be "
               f"one vLLM's CPU attention computes ({', '.join(map(str, VLLM_CPU_HEAD_SIZES))}) with "
               f"{key('inference.backend')}=vllm on the CPU; e.g. {key('model.tiny.num_attention_heads')}="
               f"{max(1, tiny.hidden_size // 32)} (and {key('model.tiny.num_key_value_heads')} dividing it)")


def _selected_workflows_own_rules(cfg: ExperimentConfig, key: Key) -> Iterator[str]:
    """What the selected workflow and advantage require of the rest of the config (their optional `config_problems`,
    such as openai_agent's named agent or remax's REINFORCE loss)."""
    from areal_pipeline.training.advantage_registry import advantage_config_problems
    from areal_pipeline.workflows import workflow_class

    config_problems = getattr(workflow_class(cfg.rollout.workflow), "config_problems", None)
    if config_problems is not None:
        yield from config_problems(cfg, key)
    yield from advantage_config_problems(cfg, key)


def _evaluation_has_prompts(cfg: ExperimentConfig, key: Key) -> Iterator[str]:
    d = cfg.dataset
    empty = ("dataset.max_test_size" if d.max_test_size == 0 else
             "dataset.arithmetic_test_size" if d.name == "arithmetic" and d.arithmetic_test_size == 0 else None)
    if cfg.eval_freq > 0 and empty:
        yield (f"{key('eval_freq')}={cfg.eval_freq}: must be 0 when the test split is empty "
               f"({key(empty)}=0), or evaluation scores no prompts")


def _warm_start_in_the_run_format(cfg: ExperimentConfig, key: Key) -> Iterator[str]:
    """A curriculum that wrote whole episodes in one format (its module's `WRITTEN_FOR`: dotted key -> value)
    makes a base model that only knows that format; the embedded model it warm-starts runs in it."""
    import importlib

    tiny = cfg.model.tiny
    if cfg.model.path or tiny.pretrain_steps == 0:
        return
    module = importlib.import_module(CURRICULA[tiny.pretrain_task].split(":")[0])
    for dotted, value in getattr(module, "WRITTEN_FOR", {}).items():
        actual = cfg
        for part in dotted.split("."):
            actual = getattr(actual, part)
        if actual != value:
            yield (f"{key(dotted)}={actual!r}: must be {value!r} with the embedded model warm-started on the "
                   f"'{tiny.pretrain_task}' curriculum ({key('model.tiny.pretrain_task')}), whose episodes are in "
                   f"that format; set {key('model.tiny.pretrain_task')} to one in this format, "
                   f"{key('model.tiny.pretrain_steps')}=0, or {key('model.path')}")


def _gpus_placed_consistently(cfg: ExperimentConfig, key: Key) -> Iterator[str]:
    """The GPU lists against what the processes need (areal_pipeline/placement.py places them at launch, against the
    GPUs the machine has): one GPU per NCCL rank, tp_size*dp_size per SGLang server, shared ones only when asked."""
    from areal_pipeline.placement import gpus_per_server

    inf, t = cfg.inference, cfg.trainer
    per_server = gpus_per_server(inf)
    if inf.addresses:
        if inf.gpus:
            yield (f"{key('inference.gpus')}={inf.gpus}: must be empty with {key('inference.addresses')} set (the "
                   "run launches no server)")
        if inf.num_servers not in (1, len(inf.addresses)):
            yield (f"{key('inference.num_servers')}={inf.num_servers}: must be the number of "
                   f"{key('inference.addresses')} ({len(inf.addresses)}) or left at 1 (the run launches no server)")
    elif inf.gpus and per_server == 0:
        yield (f"{key('inference.gpus')}={inf.gpus}: must be empty while the servers run on the CPU "
               f"({key('inference.backend')}=cpu, {key('inference.device')}=cpu); set {key('inference.device')}=cuda "
               f"or {key('inference.backend')}=sglang to serve on GPUs")
    elif inf.gpus and len(inf.gpus) != per_server * inf.num_servers:
        yield (f"{key('inference.gpus')}={inf.gpus}: must name {per_server * inf.num_servers} GPU(s): "
               f"{inf.num_servers} server(s) x {per_server} ("
               + ("tp_size x dp_size" if inf.backend == "sglang" else "one for each of the project's servers") + ")")
    if t.gpus and t.device == "cpu":
        yield f"{key('trainer.gpus')}={t.gpus}: must be empty with {key('trainer.device')}=cpu"
    elif t.gpus and t.backend != "gloo" and len(t.gpus) != t.nproc:
        yield (f"{key('trainer.gpus')}={t.gpus}: must name {key('trainer.nproc')}={t.nproc} GPU(s), one per rank"
               + (": NCCL never puts two ranks on one GPU" if len(t.gpus) < t.nproc else ""))
    shared = sorted(set(inf.gpus) & set(t.gpus)) if per_server else []
    if shared and not t.colocate:
        yield (f"{key('inference.gpus')}={inf.gpus} and {key('trainer.gpus')}={t.gpus} share GPU(s) {shared}: set "
               f"{key('trainer.colocate')}=true to share them (splitting their memory), or place them apart")
    if t.colocate and per_server and t.device != "cpu":
        share = inf.sglang.mem_fraction_static
        if share + t.memory_fraction >= 1:
            yield (f"{key('trainer.memory_fraction')}={t.memory_fraction}: with {key('trainer.colocate')}=true it "
                   f"and {key('inference.sglang.mem_fraction_static')}={share} split one GPU's memory: their sum "
                   "must be below 1, with room left for both processes' CUDA contexts and activations "
                   "(e.g. 0.4 and 0.5)")


_LOOPBACK = re.compile(r"(127\.\d+\.\d+\.\d+|localhost)")


def _weights_reach_the_servers(cfg: ExperimentConfig, key: Key) -> Iterator[str]:
    """Weight updates must be able to reach every server: SGLang takes them over NCCL only from a trainer on a
    GPU, and servers on other hosts neither read this host's run directory nor reach its loopback."""
    inf, t = cfg.inference, cfg.trainer
    if t.weight_sync == "distributed" and t.device == "cpu" and inf.backend == "sglang" and not inf.addresses:
        yield (f"{key('trainer.weight_sync')}='distributed': SGLang servers receive weights over NCCL, which a "
               f"trainer on the CPU ({key('trainer.device')}=cpu) cannot take part in; use "
               f"{key('trainer.weight_sync')}=disk")
    if t.weight_sync == "distributed" and inf.backend == "vllm":
        yield (f"{key('trainer.weight_sync')}='distributed': not supported with {key('inference.backend')}=vllm "
               "(vLLM's weight transfer engine needs GPUs on both sides and is not wired to this trainer); use "
               f"{key('trainer.weight_sync')}=disk (each version is loaded with vLLM's reload_weights)")
    if t.weight_sync == "distributed" and inf.backend == "sglang" and inf.sglang.dp_size > 1:
        yield (f"{key('inference.sglang.dp_size')}={inf.sglang.dp_size}: must be 1 with "
               f"{key('trainer.weight_sync')}='distributed' (SGLang updates weights from a process group only "
               f"without data parallelism inside a server); run more servers ({key('inference.num_servers')}) or "
               f"use {key('trainer.weight_sync')}=disk")
    remote = [a for a in inf.addresses if not _LOOPBACK.fullmatch(a.rsplit(":", 1)[0])]
    if remote and t.weight_sync == "distributed" and _LOOPBACK.fullmatch(t.weight_sync_master_address):
        yield (f"{key('trainer.weight_sync_master_address')}={t.weight_sync_master_address!r}: servers on other "
               f"hosts ({', '.join(remote)}) cannot reach it; set it to this host's address they reach")
    if remote and t.weight_sync == "disk" and not t.weights_dir:
        yield (f"{key('trainer.weights_dir')}='': servers on other hosts ({', '.join(remote)}) load each version "
               "from a directory: set it to one they read at the same path (a shared file system)")


# Rules between fields of one section, run once every field passed its own rules (they divide and compare them).
CROSS_RULES: dict[type, tuple[Callable[[Any, Key], Iterator[str]], ...]] = {
    TinyModelConfig: (_attention_heads_divide,),
    RetrievalConfig: (_default_topk_within_max,),
    ExperimentConfig: (_generation_fits_context, _evaluation_has_prompts, _warm_start_in_the_run_format,
                       _selected_workflows_own_rules, _gpus_placed_consistently,
                       _weights_reach_the_servers, _vllm_serves_the_embedded_model),
}


def validate(section: Any, prefix: str = "") -> None:
    """Check a config (or one section of it, `prefix` being its dotted key and a dot) against FIELD_RULES and
    CROSS_RULES: ConfigError lists every value broken, each as `<dotted key>=<value>: must be <what is allowed>`."""
    sections = list(_sections(section, prefix))
    problems = [problem for node, at in sections for problem in _field_problems(node, at)]
    if not problems:
        problems = [problem for node, at in sections for rule in CROSS_RULES.get(type(node), ())
                    for problem in rule(node, lambda name, at=at: at + name)]
    if problems:
        raise ConfigError("; ".join(problems))


def _sections(node: Any, prefix: str) -> Iterator[tuple[Any, str]]:
    """(section, its dotted prefix) for `node` and every section nested in it."""
    yield node, prefix
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            yield from _sections(value, f"{prefix}{f.name}.")


def field_rules_of(schema: type) -> dict[str, Rule | tuple[Rule, ...]]:
    """A section's field rules: FIELD_RULES' for its class, and those the class (or a base) declares itself as a
    ClassVar `field_rules`, as a workflow's own config section does, so its rules come with it."""
    rules: dict[str, Rule | tuple[Rule, ...]] = {}
    for klass in reversed(schema.__mro__):
        rules.update(vars(klass).get("field_rules", {}))
        rules.update(FIELD_RULES.get(klass, {}))
    return rules


def _field_problems(node: Any, prefix: str) -> Iterator[str]:
    rules = field_rules_of(type(node))
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if value is None or dataclasses.is_dataclass(value):
            continue
        setting = f"{prefix}{f.name}={value!r}"
        if isinstance(value, float) and not math.isfinite(value):
            yield f"{setting}: must be a finite number"
            continue
        rule_or_rules = rules.get(f.name, ())
        broken = next((r for r in (rule_or_rules if isinstance(rule_or_rules, tuple) else (rule_or_rules,))
                       if not r.holds(value)), None)
        if broken is not None:
            yield f"{setting}: must be {broken.allowed}"
