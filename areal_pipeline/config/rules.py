"""The configuration's value rules: what each field may be (FIELD_RULES) and what fields of one section must be
to each other (CROSS_RULES), checked by `validate`. A bad value is an error naming its dotted key, what it is and
what is allowed. These are the generic rules, which need nothing but the config; the rules that need the
project's registries (the workflow, the loss, the warm start, GPU placement) are the run assembly's
(areal_pipeline/run_spec.py), which passes them to `validate` alongside these; and what a selected workflow or
advantage requires of the rest of the config is its own `config_problems`, so that a user's brings its rules along.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from areal_pipeline.config.recurring import LineServeConfig, RecurringConfig
from areal_pipeline.config.schema import (DatasetConfig, ExperimentConfig, GenerationConfig, InferenceConfig,
                                          JudgeConfig, LoRAConfig,
                                          ModelConfig, NormConfig, OptimizerConfig, PPOConfig, RetrievalConfig,
                                          MlflowConfig, RolloutConfig, SGLangConfig, TinyModelConfig, TrackersConfig,
                                          TrainerConfig, VLLMConfig, WandbConfig)
from areal_pipeline.config.addresses import split_address
from areal_pipeline.config.lora_rules import adapter_push_is_possible
from areal_pipeline.config.host_rules import (hosts_reach_each_other, only_the_projects_server_records,
                                              weights_reach_the_servers)
from areal_pipeline.errors import PermanentError


class ConfigError(PermanentError, ValueError):
    pass



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
# a host name or IPv4 address: a bare IPv6 host would need brackets in the URLs the processes build from an address
_ADDRESS_HOST = re.compile(r"[\w.-]+")


def _is_address(value: Any) -> bool:
    """host:port, the port in range (addresses.split_address's check) and the host a name or an IPv4 address."""
    try:
        host, _ = split_address(value)
    except (ValueError, AttributeError):
        return False
    return bool(_ADDRESS_HOST.fullmatch(host))


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

_POSITIVE = above(0)
_FRACTION = within(0, 1)
_PORT = within(0, 65535)  # 0: a free port
_HOST_PORT = Rule("empty or host:port", lambda value: not value or _is_address(value))
_ADAM_BETA = within(0, 1, open_high=True)
# the linear layers of a Qwen2/Llama-style decoder an adapter may sit on (the output head is not one: tied to the
# embedding in the embedded model, and vLLM and SGLang serve no adapter on it)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_GPU_LIST = Rule("a list of distinct GPU indices >= 0",
                 lambda ids: all(type(i) is int and i >= 0 for i in ids) and len(set(ids)) == len(ids))
_ADDRESSES = Rule("a list of distinct host:port addresses",
                  lambda addresses: all(_is_address(a) for a in addresses)
                  and len(set(addresses)) == len(addresses))
_NAMED = Rule("a non-empty name", lambda name: bool(name.strip()))
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
                      "pretrain_steps": _NON_NEGATIVE, "pretrain_batch_size": _COUNT, "pretrain_micro_batches": _COUNT,
                      "pretrain_lr": _POSITIVE, "pretrain_off_by_one": _FRACTION},
    DatasetConfig: {"path": (_local_path_or_hub_id("openai/gsm8k"), _NOT_EMPTY), "max_train_size": _COUNT,
                    "max_test_size": _NON_NEGATIVE, "arithmetic_train_size": _COUNT,
                    "arithmetic_test_size": _NON_NEGATIVE, "arithmetic_max_operand": _NON_NEGATIVE,
                    "grid_size": at_least(2), "grid_pits": at_least(0)},
    SGLangConfig: {"tp_size": _COUNT, "dp_size": _COUNT, "mem_fraction_static": within(0, 1, open_low=True),
                   "context_length": _COUNT, "python": _EXECUTABLE_OR_EMPTY,
                   "dtype": one_of("auto", "half", "float16", "bfloat16", "float", "float32")},
    VLLMConfig: {"python": _VLLM_PYTHON, "dtype": one_of("auto", *_DTYPES), "max_model_len": _COUNT,
                 "env": _ENV_VARS},
    InferenceConfig: {"backend": one_of("cpu", "sglang", "vllm"), "num_servers": _COUNT, "base_port": _PORT,
                      "verify_tolerance": _NON_NEGATIVE,
                      "setup_timeout": _POSITIVE, "request_timeout": _POSITIVE, "request_retries": _NON_NEGATIVE,
                      "pause_timeout": _POSITIVE,
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
    # rollout.agent: each workflow's section carries its own rules (`field_rules`, see field_rules_of); rollout.workflow,
    # ppo.loss and model.tiny.pretrain_task: the run assembly's (run_spec.RUN_FIELD_RULES)
    RolloutConfig: {"batch_size": _COUNT, "max_head_offpolicyness": _NON_NEGATIVE,
                    "max_concurrent_rollouts": _COUNT, "reward_timeout": _POSITIVE, "reward_workers": _COUNT,
                    "shard_rows": _COUNT, "journal_delay": _NON_NEGATIVE, "episode_retries": _NON_NEGATIVE, "episode_retry_delay": _NON_NEGATIVE,
                    "episode_timeout": _NON_NEGATIVE, "on_failure": one_of("drop", "mask", "refill", "fail"),
                    "min_group_survivors": _COUNT, "max_failure_rate": _FRACTION},
    JudgeConfig: {"base_url": Rule("empty or an http(s) URL",
                                   lambda url: not url or bool(re.match(r"https?://[^/\s]+", url))),
                  "api_key_env": Rule("empty or an environment variable's name (not the key itself)",
                                      lambda name: not name or bool(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name))),
                  "temperature": _NON_NEGATIVE, "max_tokens": _COUNT, "timeout": _POSITIVE,
                  "retries": _NON_NEGATIVE, "retry_delay": _NON_NEGATIVE, "max_concurrency": _COUNT,
                  "slot_timeout": _POSITIVE, "context_length": _COUNT,
                  "prompt_price_per_mtok": _NON_NEGATIVE, "completion_price_per_mtok": _NON_NEGATIVE},
    NormConfig: {"mean_level": _NORM_LEVEL, "std_level": _NORM_LEVEL, "eps": _POSITIVE},
    PPOConfig: {"ppo_n_minibatches": _COUNT, "eps_clip": within(0, 1, open_low=True),
                "eps_clip_higher": _POSITIVE, "c_clip": above(1), "importance_sampling_level": one_of("token", "sequence"),
                "behav_imp_weight_cap": at_least(1), "reward_bias": _FINITE, "reward_scaling": _FINITE,
                "reward_clip": _POSITIVE, "kl_ctl": _NON_NEGATIVE, "kl_estimator": one_of("k1", "k2", "k3"),
                "discount": _FRACTION, "gae_lambda": _FRACTION, "gigpo_step_weight": _NON_NEGATIVE,
                "gigpo_discount": _FRACTION, "gigpo_norm": one_of("std", "none")},
    OptimizerConfig: {"lr": _POSITIVE, "weight_decay": _NON_NEGATIVE, "beta1": _ADAM_BETA, "beta2": _ADAM_BETA,
                      "eps": _POSITIVE, "gradient_clipping": _POSITIVE,
                      "lr_scheduler_type": one_of("constant", "linear", "cosine"),
                      "warmup_steps_proportion": _FRACTION, "min_lr_ratio": _FRACTION,
                      "schedule_iterations": _COUNT},
    TrainerConfig: {"nproc": _COUNT, "nnodes": _COUNT, "backend": one_of("auto", "nccl", "gloo"),
                    "param_dtype": one_of("auto", *_DTYPES),
                    "num_threads": _NON_NEGATIVE, "mb_max_tokens": _COUNT,
                    "weight_sync": one_of("disk", "distributed"), "setup_timeout": _POSITIVE,
                    "command_timeout": _POSITIVE, "collective_timeout": _POSITIVE, "gpus": _GPU_LIST,
                    "memory_fraction": within(0, 1, open_low=True),
                    "weight_sync_master_address": Rule("empty or a host name or IP address",
                                                       lambda host: not host or _HOST.holds(host)),
                    "weight_sync_master_port": _PORT, "weight_sync_bucket_mb": _COUNT,
                    "address": Rule("empty, auto or host:port",
                                    lambda value: value in ("", "auto") or _is_address(value)),
                    "rdzv_endpoint": _HOST_PORT, "port": _PORT, "max_restarts": _NON_NEGATIVE},
    LoRAConfig: {"rank": _COUNT, "alpha": _POSITIVE, "dropout": within(0, 1, open_high=True),
                 "target_modules": Rule(f"[all-linear] or names among {', '.join(LORA_TARGETS)}",
                                        lambda names: list(names) == ["all-linear"]
                                        or (bool(names) and all(n in LORA_TARGETS for n in names))),
                 "init": one_of("kaiming", "gaussian"), "push": one_of("auto", "adapter", "merged"),
                 "base_dtype": one_of("auto", "float32", "bfloat16")},
    TrackersConfig: {"timeout": _POSITIVE},
    RecurringConfig: {"line": Rule("empty or a name of letters, digits, '.', '_' and '-' (a directory and a "
                                   "deployment are named after it)",
                                   lambda name: not name or bool(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name))),
                      "iterations": _NON_NEGATIVE, "max_rows": _NON_NEGATIVE,
                      "replay_fraction": within(0, 1, open_high=True), "gate_split": _NAMED,
                      "gate_max_prompts": _NON_NEGATIVE, "gate_test": one_of("bootstrap", "mcnemar"),
                      "min_improvement": _NON_NEGATIVE, "confidence": within(0, 1, open_low=True, open_high=True),
                      "gate_resamples": at_least(100), "approval": one_of("auto", "manual"),
                      "approval_timeout": _POSITIVE, "wait_timeout": _POSITIVE,
                      "traffic_fraction": within(0, 1), "feedback_window": _POSITIVE,
                      "max_staleness": _NON_NEGATIVE, "traffic_min_group": at_least(2),
                      "traffic_reward": Rule("empty or 'module:function' / 'path/file.py:function'",
                                             lambda ref: not ref or ":" in ref.strip(":"))},
    LineServeConfig: {"addresses": _ADDRESSES, "backend": one_of("", "cpu", "vllm", "sglang"),
                      "num_servers": _NON_NEGATIVE, "host": _HOST, "base_port": _PORT,
                      "record_rotate_mb": _POSITIVE, "record_rotate_s": _POSITIVE, "retention_days": _NON_NEGATIVE},
    WandbConfig: {"mode": one_of("online", "offline", "disabled"), "project": _NAMED},
    MlflowConfig: {"experiment": _NAMED,
                   "tracking_uri": Rule("empty or a URI (http://host:port, file:///path, sqlite:///path, ...)",
                                        lambda uri: not uri or bool(re.match(r"[a-z][\w+.-]*:", uri)))},
}

Key = Callable[[str], str]  # a field name (or dotted path) within a section -> its dotted key in the config
CrossRule = Callable[[Any, Key], Iterator[str]]  # a section and its Key -> the problems it breaks


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



def _mask_keeps_enough_survivors(rollout: RolloutConfig, key: Key) -> Iterator[str]:
    if rollout.on_failure == "mask" and rollout.gconfig.n_samples < rollout.min_group_survivors:
        yield (f"{key('min_group_survivors')}={rollout.min_group_survivors}: must be <= "
               f"{key('gconfig.n_samples')}={rollout.gconfig.n_samples} with {key('on_failure')}='mask', or every "
               "group with a failed episode is dropped")


def _judge_is_complete(cfg: ExperimentConfig, key: Key) -> Iterator[str]:
    """rollout.group_reward=judge needs a judge model at an endpoint. (What a workflow or an advantage cannot take
    of a group reward is its own `config_problems`: multi_turn's per-turn returns, ReMax's baseline episode.)"""
    if cfg.rollout.group_reward != "judge":
        return
    if cfg.judge.serve:
        if cfg.judge.base_url:
            yield (f"{key('judge.base_url')}={cfg.judge.base_url!r} with {key('judge.serve')}=true: the run serves "
                   "its judge itself and asks that one; give one of the two (docs/judge.md)")
        if not cfg.judge.model_path:
            yield (f"{key('judge.model_path')}: empty, with {key('judge.serve')}=true: name the judge model the run "
                   "serves (a Hugging Face directory or hub id of an instruction-tuned model); no judge is built in "
                   "code (docs/judge.md)")
    else:
        for name in ("base_url", "model"):
            if not getattr(cfg.judge, name):
                yield (f"{key('judge.' + name)}: empty, with {key('rollout.group_reward')}=judge: the judge needs "
                       "an OpenAI-compatible endpoint (judge.base_url, e.g. http://127.0.0.1:8000/v1) and the model "
                       "it serves (judge.model), or judge.serve=true to serve one itself; docs/judge.md")


def _schedule_covers_the_run(cfg: ExperimentConfig, key: Key) -> Iterator[str]:
    """Past schedule_iterations a decaying schedule stays at its end, lr x min_lr_ratio: iterations there at a rate
    of 0 would train nothing while looking like a run."""
    o = cfg.trainer.optimizer
    if (o.lr_scheduler_type != "constant" and o.min_lr_ratio == 0 and o.schedule_iterations is not None
            and cfg.total_iterations > o.schedule_iterations):
        yield (f"{key('total_iterations')}={cfg.total_iterations}: past "
               f"{key('trainer.optimizer.schedule_iterations')}={o.schedule_iterations} the {o.lr_scheduler_type} "
               f"schedule stays at its end, lr x {key('trainer.optimizer.min_lr_ratio')} = 0, so those iterations "
               f"would not train; raise {key('trainer.optimizer.schedule_iterations')}, set "
               f"{key('trainer.optimizer.min_lr_ratio')} > 0, or use lr_scheduler_type=constant")


def _evaluation_has_prompts(cfg: ExperimentConfig, key: Key) -> Iterator[str]:
    d = cfg.dataset
    empty = ("dataset.max_test_size" if d.max_test_size == 0 else
             "dataset.arithmetic_test_size" if d.name == "arithmetic" and d.arithmetic_test_size == 0 else None)
    if cfg.eval_freq > 0 and empty:
        yield (f"{key('eval_freq')}={cfg.eval_freq}: must be 0 when the test split is empty "
               f"({key(empty)}=0), or evaluation scores no prompts")



# A tracker's package, and what installs it
TRACKER_PACKAGES = {"tensorboard": ("tensorboard", "pip install 'areal-pipeline[tensorboard]'"),
                    "wandb": ("wandb", "pip install 'areal-pipeline[wandb]'"),
                    "mlflow": ("mlflow", "pip install 'areal-pipeline[mlflow]'")}


def _trackers_are_installed(trackers: TrackersConfig, key: Key) -> Iterator[str]:
    enabled = {"tensorboard": trackers.tensorboard, "wandb": trackers.wandb.active,
               "mlflow": trackers.mlflow.enabled}
    for name, on in enabled.items():
        package, install = TRACKER_PACKAGES[name]
        if on and importlib.util.find_spec(package) is None:
            setting = key("tensorboard") if name == "tensorboard" else key(f"{name}.enabled")
            yield f"{setting}=True: needs the {package} package, not installed here ({install})"


# Rules between fields of one section, run once every field passed its own rules (they divide and compare them).
CROSS_RULES: dict[type, tuple[CrossRule, ...]] = {
    TinyModelConfig: (_attention_heads_divide,),
    RetrievalConfig: (_default_topk_within_max,),
    RolloutConfig: (_mask_keeps_enough_survivors,),
    TrackersConfig: (_trackers_are_installed,),
    ExperimentConfig: (_generation_fits_context, _evaluation_has_prompts, weights_reach_the_servers,
                       hosts_reach_each_other, _vllm_serves_the_embedded_model, _judge_is_complete,
                       _schedule_covers_the_run, adapter_push_is_possible, only_the_projects_server_records),
}

FieldRules = Mapping[type, Mapping[str, "Rule | tuple[Rule, ...]"]]
CrossRules = Mapping[type, tuple[CrossRule, ...]]


def validate(section: Any, prefix: str = "", *, field_rules: FieldRules = FIELD_RULES,
             cross_rules: CrossRules = CROSS_RULES) -> None:
    """Check a config (or one section of it, `prefix` being its dotted key and a dot) against `field_rules` and
    `cross_rules` (the generic ones by default; the run assembly passes its own, these included): ConfigError
    lists every value broken, each as `<dotted key>=<value>: must be <what is allowed>`."""
    sections = list(_sections(section, prefix))
    problems = [problem for node, at in sections for problem in _field_problems(node, at, field_rules)]
    if not problems:
        problems = [problem for node, at in sections for rule in cross_rules.get(type(node), ())
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



def field_rules_of(schema: type, field_rules: FieldRules = FIELD_RULES) -> dict[str, Rule | tuple[Rule, ...]]:
    """A section's field rules: `field_rules`' for its class, and those the class (or a base) declares itself as a
    ClassVar `field_rules`, as a workflow's own config section does, so its rules come with it."""
    rules: dict[str, Rule | tuple[Rule, ...]] = {}
    for klass in reversed(schema.__mro__):
        rules.update(vars(klass).get("field_rules", {}))
        rules.update(field_rules.get(klass, {}))
    return rules


def _field_problems(node: Any, prefix: str, field_rules: FieldRules) -> Iterator[str]:
    rules = field_rules_of(type(node), field_rules)
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
