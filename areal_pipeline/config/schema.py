"""The configuration's schema: every section's dataclass, its fields' defaults and, beside each field, its
documentation (`areal-pipeline config KEY` prints it). A leaf: it imports nothing of the project but its sibling
integrations.py (the sections of the services a run talks to: trackers, the LLM judge).

`rollout.agent` holds the selected workflow's own section; which class that is, the run assembly decides
(areal_pipeline/run_spec.py): here it is an empty section.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from areal_pipeline.config.integrations import JudgeConfig, MlflowConfig, TrackersConfig, WandbConfig  # noqa: F401
from areal_pipeline.config.recurring import LineServeConfig, RecurringConfig  # noqa: F401

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
    # Rows of a step run in this many micro-batches of similar length, gradients accumulated: the same loss (the
    # mean over the batch's labelled tokens) with less padding where lengths vary widely (the search episodes).
    # A batch with a long shared prompt runs it once instead (warm_start.SHARED_PREFIX_MIN_TOKENS), in one piece.
    pretrain_micro_batches: int = 1
    pretrain_lr: float = 3e-3  # the warm start's learning rate (AdamW)
    # Share of pretraining answers written one too high: a habit the base model picks up (greedy answers
    # are mostly wrong, sampled ones right about 1 - this share of the time) and RL has to unlearn.
    pretrain_off_by_one: float = 0.7


@dataclass
class DatasetConfig:
    # arithmetic (generated), gsm8k, search_qa, grid (generated puzzles for the grid_world workflow)
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
    grid_size: int = 5  # grid generator: puzzles on a grid_size x grid_size square
    grid_pits: int = 0  # grid generator: pits a puzzle has (stepping into one ends the walk with 0)


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
    # seconds a paused server (a weight update in flight) may stay paused before its requests fail, naming it
    pause_timeout: float = 600.0
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


@dataclass
class NoAgentConfig:
    """rollout.agent of a workflow that declares no config_class: no keys."""


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
    # seconds a reward function may take on one answer: past it its worker is killed and replaced, and the episode
    # fails with cause reward_timeout (rollout.on_failure), never a score of 0
    reward_timeout: float = 5.0
    reward_workers: int = 1  # processes of the reward pool that score answers
    # A reward that scores each prompt's whole group at once, replacing the workflow's rewards: "judge" (an LLM
    # judge behind an OpenAI-compatible endpoint: the `judge` section), or a builder of your own as "module:attr"
    # (areal_pipeline/rewards/group.py). Empty: the workflow's own rewards
    group_reward: str = ""
    shard_rows: int = 256  # trajectories per Parquet shard of a rollout
    # Seconds the episode journal holds finished groups in memory before it first writes (rollout/journal.py): a
    # rollout shorter than this writes no journal at all, and a kill loses at most this much of its played groups
    journal_delay: float = 2.0
    # An episode that fails (an inference, tool or reward server error or timeout, an agent that raised) is played
    # again from a fresh environment with the same seed, up to this many times
    episode_retries: int = 2
    episode_retry_delay: float = 1.0  # seconds before an episode's first retry, doubling with each retry after it
    episode_timeout: float = 1800.0  # seconds one attempt at an episode may take; 0: no limit but the node's
    # When an episode's retries run out: drop (its group is left out of the batch) | mask (the group keeps the
    # episodes that succeeded) | refill (the group is replaced by a reserve prompt's) | fail (the rollout node
    # fails). A failed episode never scores 0
    on_failure: str = "drop"
    min_group_survivors: int = 2  # on_failure=mask: a group with fewer episodes left is dropped
    # More than this fraction of an iteration's episodes failed for good: the rollout node fails, naming the causes
    max_failure_rate: float = 0.2
    # sampling of the episodes' generations (evaluation: greedy, one sample)
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    # the selected workflow's own section (its config_class): the package's workflows share one, AgentConfig
    # (workflows/agent_config.py); a workflow of your own gets its keys here. Chosen at load by the run assembly
    # (run_spec.py), the class depending on `workflow`
    agent: Any = field(default_factory=NoAgentConfig, metadata={"section": lambda: NoAgentConfig})


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
    # gigpo: A = A^E + gigpo_step_weight * A^S, the episode advantage plus the step-level one (GiGPO's omega)
    gigpo_step_weight: float = 1.0
    # gigpo: discount of the step rewards over an episode's steps, R_t = r_t + gigpo_discount * R_{t+1} (its gamma)
    gigpo_discount: float = 0.95
    # gigpo: a step group's returns are centred and divided by their std (std), or only centred (none: mean_norm)
    gigpo_norm: str = "std"
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
    # Iterations the schedule spans, warm-up share and decay included, counted from the run's first iteration (a
    # branch's and a line's from their lineage's): fixed when the run is first configured, so that `--iterations`,
    # a Retry or a scheduled continuation never lays the schedule anew. Past it the rate stays at its end value.
    # None: total_iterations as the config gives it (not as `--iterations` extends it)
    schedule_iterations: Optional[int] = None


@dataclass
class LoRAConfig:
    """Low-rank adapters (peft's LoRA) trained over a frozen base (docs/lora.md): off by default."""
    enabled: bool = False  # true: the base frozen, the adapters trained, served merged into it
    rank: int = 8  # r: the adapters' inner dimension
    alpha: float = 16.0  # the update is scaled by alpha / rank (alpha / sqrt(rank) with use_rslora)
    dropout: float = 0.0  # dropout on the adapters' input, in training only
    # the base's linear layers that get adapters: peft's "all-linear" (every one but the output head) or names
    # among q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    # how A is drawn (B starts at 0 either way, so version 0 is the base): "kaiming" (peft's default) or "gaussian"
    init: str = "kaiming"
    use_rslora: bool = False  # rank-stabilised LoRA: the update scaled by alpha / sqrt(rank)
    # the frozen base's storage in the trainer (the adapters stay float32): "auto" is bfloat16 on CUDA (half the
    # base's memory; it is never updated, so it needs no float32 master copy), float32 elsewhere
    base_dtype: str = "auto"
    # what a push sends the servers: "adapter" (the adapter alone, loaded by the engine's runtime LoRA: vLLM's, with
    # weight_sync=disk), "merged" (the base with the adapter merged in, as full weights: every backend) or "auto"
    # (adapter where it can go alone, merged elsewhere)
    push: str = "auto"


@dataclass
class TrainerConfig:
    nproc: int = 1  # ranks per node (torchrun --nproc-per-node)
    # nodes (torchrun --nnodes); more than 1: each node runs `areal-pipeline trainer-node` (started by a scheduler,
    # docs/multi-node.md), they meet at trainer.rdzv_endpoint, and the run reaches rank 0 at trainer.address
    nnodes: int = 1
    torchrun_args: list[str] = field(default_factory=list)  # more torchrun options, passed as they are
    # A trainer already running on nodes of its own (`areal-pipeline trainer-node` on each): its rank 0's control
    # endpoint as host:port, or "auto": the address rank 0 announces in <run_dir>/trainer/endpoint.json (a path
    # every host reads). The run uses it, never starts or stops it. Empty: the run launches the trainer here
    address: str = ""
    # host:port of the trainer nodes' c10d rendezvous (nnodes > 1): an address of the first node, reached by all
    rdzv_endpoint: str = ""
    port: int = 0  # the control endpoint's port on a trainer node (rank 0's; 0: a free one, announced)
    # A trainer node's torchrun --max-restarts: when a rank fails (a peer node lost), the node's ranks restart and
    # meet again at the rendezvous, once the scheduler has started the lost node anew
    max_restarts: int = 3
    backend: str = "auto"  # auto: nccl on CUDA, gloo on CPU
    device: str = "auto"  # auto | cpu | cuda
    param_dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU (mixed precision, fp32 master weights)
    # torch threads per rank; 0: torch's default, or in asynchronous mode on CPU the cores the CPU inference
    # servers leave (at least 1)
    num_threads: int = 0
    mb_max_tokens: int = 8192  # micro-batch token budget for packed sequences
    # seconds a collective (the ranks' rendezvous and barriers, the weight-update group's broadcasts) may wait for
    # its peers before it fails, naming them
    collective_timeout: float = 600.0
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
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # train adapters only, over the frozen base
    # how new weights reach the servers: disk (a Hugging Face directory they load) | distributed (a broadcast
    # over a process group they join: NCCL where trainer and servers are on CUDA, gloo otherwise)
    weight_sync: str = "disk"
    # weight_sync=disk: where the trainer writes each version for the servers to load (<dir>/<run_id>/v<k>); empty:
    # <run_dir>/weights. Servers on another host need a shared path, the same on both
    weights_dir: str = ""
    # weight_sync=distributed: the address the servers reach the trainer's weight-update group at (a local master
    # binds it alone); empty: the host of the trainer's control endpoint (127.0.0.1 for a trainer launched here)
    weight_sync_master_address: str = ""
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
    # seconds the trainer has to load the model and answer after its launch; for a trainer at trainer.address, how
    # long the run waits for it to answer (its nodes starting, or a lost node being started again)
    setup_timeout: float = 300.0
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
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # the LLM judge of rollout.group_reward=judge
    ppo: PPOConfig = field(default_factory=PPOConfig)  # the algorithm: rewards, advantages, loss
    trainer: TrainerConfig = field(default_factory=TrainerConfig)  # the training processes and the optimizer
    total_iterations: int = 10  # RL iterations of the run (rollout, update, weights to the servers)
    save_freq: int = 1  # checkpoint every N iterations (and after the last)
    keep_checkpoints: int = 2  # newest K kept
    # besides the newest keep_checkpoints, keep the checkpoint whose iteration scored the best eval pass@1 (and any
    # checkpoint a line pinned as its champion's: never pruned)
    keep_best_checkpoint: bool = True
    eval_freq: int = 0  # pass@1 on the test split every N iterations (and after the last); 0: off
    eval_max_prompts: int = 0  # 0: the whole test split
    # experiment trackers besides Prefect: TensorBoard, Weights & Biases, MLflow (the former top-level `tensorboard`
    # key is trackers.tensorboard)
    trackers: TrackersConfig = field(default_factory=TrackersConfig)
    # recurring training: a line of champions, each firing a candidate gated against the champion (docs/recurring.md)
    recurring: RecurringConfig = field(default_factory=RecurringConfig)
    # Iterations per Prefect flow run of the `train` flow (`<run>/iter-<k>`, or `<run>/iter-<k>..<k+n-1>`), each
    # node still a task run of its own. A flow run costs the Prefect API several synchronous calls and CPU beside
    # the nodes: worth it where an iteration takes minutes, not where it takes a fraction of a second.
    iterations_per_flow_run: int = 1

    def __post_init__(self) -> None:
        if self.ppo.use_decoupled_loss is None:
            self.ppo.use_decoupled_loss = self.rollout.max_head_offpolicyness > 0
        if self.trainer.optimizer.schedule_iterations is None:  # fixed now: a later `--iterations` moves no schedule
            self.trainer.optimizer.schedule_iterations = self.total_iterations

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.run_id
