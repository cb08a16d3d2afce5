"""The run assembly: a run's config loaded with its workflow's own section and every rule, and the names it gives
turned into what they name, once: the workflow class, its section, the loss, the reward function's reference, the
tool servers the workflow needs.

    run = load_run("configs/tiny_cpu.yaml", ["seed=3"])   # RunSpec(cfg, workflow_class, workflow_section, ...)
    workflow = build_workflow(run, tokenizer, reward_pool)

It sits above the registries (workflows, placement, the loss registry, the warm-start curricula, the run
directory) and below whatever runs a run (pipeline, services, tasks, flows, the command line), which are handed
the RunSpec. The configuration below it (areal_pipeline/config/) knows none of them.

Each rule lives in one place, by what it needs: one that reads the config alone is config/rules.py's; one that
needs a registry (a name that must load, the GPUs a server takes, a curriculum's format) is here; what a selected
workflow or advantage requires of the rest of the config is its `config_problems` hook, beside its code.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from areal_pipeline.config import (CROSS_RULES, FIELD_RULES, Chosen, ChosenSection, ConfigError, ExperimentConfig,
                                   Key, NoAgentConfig, PPOConfig, RolloutConfig, Rule, TinyModelConfig, build_config,
                                   layered_value, one_of, read_layers)
from areal_pipeline.placement import gpus_per_server
from areal_pipeline.rewards.pool import RewardReference
from areal_pipeline.run_dir import newest_completed_iteration
from areal_pipeline.training.advantage_registry import advantage_builder, advantage_config_problems
from areal_pipeline.training.loss_registry import LOSSES, loss_builder
from areal_pipeline.user_code import is_reference, load_attr
from areal_pipeline.warm_start import CURRICULA
from areal_pipeline.workflows import is_builtin, workflow_class


@dataclass(frozen=True)
class RunSpec:
    """A run as loaded: its config and what the config's names name, looked up once."""

    cfg: ExperimentConfig
    workflow_class: type  # the class rollout.workflow names
    workflow_section: type  # the class of cfg.rollout.agent
    loss: str  # ppo.loss, checked to name a loss builder (the trainer's processes import it)
    reward: Optional[RewardReference]  # the workflow's pooled reward function; None: it scores in process
    tools: tuple[str, ...]  # the tool servers the workflow declares (Services.start_tools)


_WORKFLOWS: dict[str, type] = {}


def _workflow(name: str) -> type:
    """The class `name` names (ValueError naming the valid names when it names none), looked up once a process."""
    if name not in _WORKFLOWS:
        _WORKFLOWS[name] = workflow_class(name)
    return _WORKFLOWS[name]


def section_class(name: str, cls: type) -> type:
    """The dataclass `rollout.agent` is an instance of when `rollout.workflow` is `name` (class `cls`). For the
    package's own workflows: `AgentConfig`, which has every built-in workflow's keys (each workflow reads its own; a
    key of another built-in workflow is accepted, as it was before each workflow declared its section). For a
    workflow of the user's own: its `config_class`, and no key at all when it declares none."""
    if is_builtin(name):
        from areal_pipeline.workflows.agent_config import AgentConfig

        return AgentConfig
    return getattr(cls, "config_class", None) or NoAgentConfig


def chosen_sections(workflow: str, where: str) -> Chosen:
    """`rollout.agent`'s class for `workflow` (where names what set it, for the error when it names no workflow)."""
    try:
        cls = _workflow(workflow)
    except ValueError as error:
        raise ConfigError(f"{where}: rollout.workflow={workflow!r}: {error}") from None
    own = getattr(cls, "config_class", None)
    keys = tuple(f.name for f in dataclasses.fields(own)) if own is not None else ()
    return {"rollout.agent": ChosenSection(section_class(workflow, cls), f"workflow {workflow}", keys)}


def builtin_sections() -> Chosen:
    """`rollout.agent` as the package's workflows read it (what `areal-pipeline config` documents by default)."""
    return chosen_sections(RolloutConfig.workflow, "the default")


def _loads(lookup) -> Any:
    """A rule's check: `lookup(name)` finds what the name names (each lookup raises ValueError otherwise)."""
    def check(name: str) -> bool:
        try:
            lookup(name)
        except ValueError:
            return False
        return True
    return check


# the package's own losses are known without importing the trainer's modules here
_LOSS = Rule("ppo, reinforce, or 'module:attr' naming an importable loss builder (training/loss_registry.py)",
             lambda name: name in LOSSES or _loads(loss_builder)(name))
_ADVANTAGE = Rule("grpo, remax, gigpo, or 'module:attr' naming an importable advantage builder "
                  "(training/advantage_registry.py)", _loads(advantage_builder))
_WORKFLOW = Rule("rlvr, reflection, multi_turn, search_agent, openai_agent, grid_world, or 'module:Class' / "
                 "'path/to/file.py:Class' naming a workflow class of your own (workflows/protocol.py)",
                 _loads(_workflow))

# The field rules that need the project's registries, besides the generic ones (config/rules.py).
RUN_FIELD_RULES = {
    **FIELD_RULES,
    RolloutConfig: {**FIELD_RULES[RolloutConfig], "workflow": _WORKFLOW},
    PPOConfig: {**FIELD_RULES[PPOConfig], "loss": _LOSS, "advantage": _ADVANTAGE},
    TinyModelConfig: {**FIELD_RULES[TinyModelConfig], "pretrain_task": one_of(*CURRICULA)},
}


def _selected_workflows_own_rules(cfg: ExperimentConfig, key: Key) -> Iterator[str]:
    """What the selected workflow and advantage require of the rest of the config (their optional
    `config_problems`, such as openai_agent's named agent or remax's REINFORCE loss)."""
    config_problems = getattr(_workflow(cfg.rollout.workflow), "config_problems", None)
    if config_problems is not None:
        yield from config_problems(cfg, key)
    yield from advantage_config_problems(cfg, key)


def _warm_start_in_the_run_format(cfg: ExperimentConfig, key: Key) -> Iterator[str]:
    """A curriculum that wrote whole episodes in one format (its module's `WRITTEN_FOR`: dotted key -> value)
    makes a base model that only knows that format; the embedded model it warm-starts runs in it."""
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


RUN_CROSS_RULES = {
    **CROSS_RULES,
    ExperimentConfig: (*CROSS_RULES[ExperimentConfig], _warm_start_in_the_run_format, _selected_workflows_own_rules,
                       _gpus_placed_consistently),
}


def load_config(path=None, overrides: Optional[list[str]] = None) -> ExperimentConfig:
    """A run's config from defaults <- YAML file <- `key=value` overrides: `rollout.agent` takes the section of the
    workflow `rollout.workflow` names once the layers are read, and every rule applies (an unknown key, a bad
    value, a workflow or loss that does not load: ConfigError naming the key)."""
    layers = read_layers(path, overrides)
    chosen = chosen_sections(*layered_value(layers, "rollout.workflow", RolloutConfig.workflow))
    return build_config(layers, ExperimentConfig, chosen, field_rules=RUN_FIELD_RULES, cross_rules=RUN_CROSS_RULES)


def resolve_run_config(config_path, overrides: Optional[list[str]] = None, run_id: Optional[str] = None,
                       iterations: Optional[int] = None) -> ExperimentConfig:
    """The run's config; `iterations` extends an existing run by that many iterations past its newest one."""
    cfg = load_config(config_path, list(overrides or []) + ([f"run_id={run_id}"] if run_id else []))
    if iterations is not None:
        cfg.total_iterations = newest_completed_iteration(cfg.run_dir) + iterations
    return cfg


def run_id_of(config_path, overrides: Optional[list[str]] = None, run_id: Optional[str] = None) -> str:
    """The run id `load_run` gives these arguments, from the YAML file and the overrides alone (no rule checked, no
    workflow or loss imported): cheap enough to name a flow run before its config loads. Loading the config is what
    checks the value."""
    if run_id:
        return str(run_id)
    value = ExperimentConfig.run_id
    for layer in read_layers(config_path, overrides):
        if isinstance(layer.data, dict) and layer.data.get("run_id") is not None:
            value = str(layer.data["run_id"])
    return value


def load_run(config_path, overrides: Optional[list[str]] = None, run_id: Optional[str] = None,
             iterations: Optional[int] = None) -> RunSpec:
    """The run `config_path` + `overrides` describe (as `resolve_run_config`), assembled."""
    return assemble(resolve_run_config(config_path, overrides, run_id, iterations))


def reward_reference(cls: type) -> Optional[RewardReference]:
    """The reward function workflow class `cls` runs in the reward pool (its `reward_function`, "module:attr"), or
    None when it scores in process (the search agent) or is scored by the agent (openai_agent)."""
    reference = getattr(cls, "reward_function", None)
    if reference is None:
        return None
    if not is_reference(reference):  # the form is checked here; whether it loads, in the pool's workers
        load_attr(reference, f"{cls.__name__}.reward_function", "function")
    return RewardReference(reference, f"{cls.__name__}.reward_function")


def assemble(cfg: ExperimentConfig) -> RunSpec:
    """The RunSpec of a config already loaded (by `load_config`, or changed in code since)."""
    cls = _workflow(cfg.rollout.workflow)
    return RunSpec(cfg, cls, type(cfg.rollout.agent), cfg.ppo.loss, reward_reference(cls),
                   tuple(getattr(cls, "tools", ())))


def build_workflow(run: RunSpec | ExperimentConfig, tokenizer, reward_pool, *,
                   tool_addresses: Optional[dict[str, str]] = None, cfg: Optional[ExperimentConfig] = None) -> Any:
    """The run's workflow, built by its class's `from_config` from `cfg` (default: the run's; evaluation passes its
    greedy one). A config in place of a RunSpec is assembled first.

    `tool_addresses` names running tool servers, e.g. {"retrieval": "127.0.0.1:8000"} for the search agent
    (see `Services.start_tools`); without one the search agent retrieves in process, from the same index.
    """
    if not isinstance(run, RunSpec):
        run = assemble(run)
    return run.workflow_class.from_config(cfg if cfg is not None else run.cfg, tokenizer, reward_pool,
                                          reward_fn=run.reward, tool_addresses=dict(tool_addresses or {}))
