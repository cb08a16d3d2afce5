"""What a rollout workflow is: the seam between the rollout and an agent (AReaL-lite's `RolloutWorkflow`).

A workflow is one class, named by `rollout.workflow`: a registered name (`workflows.WORKFLOWS`) or a class of your
own, "module:MyWorkflow" (importable from the working directory) or "path/to/file.py:MyWorkflow". The run builds
it once per rollout with `from_config`; `arun_episode` plays ONE episode. The rollout (rollout/group.py) owns the
group: it plays `rollout.gconfig.n_samples` episodes per prompt at once, many prompts concurrently, and sets each
trajectory's `group_id` (the prompt) and `sample_idx` (the episode's index in the group).

    @dataclass
    class MyConfig:                                 # rollout.agent.* when rollout.workflow names MyWorkflow
        max_turns: int = 3  # model turns per episode (the comment is its help: areal-pipeline config ...)
        field_rules: ClassVar[dict] = {"max_turns": config.at_least(1)}   # optional, checked at load

    class MyWorkflow:
        config_class = MyConfig                     # None: the workflow takes no rollout.agent keys
        reward_function = "my_rewards:score"        # "module:attr" run in the reward pool, or None
        tools = ()                                  # tool servers the run starts for it: ("retrieval",)

        @classmethod
        def from_config(cls, cfg, tokenizer, reward_pool, *, reward_fn, tool_addresses):
            return cls(cfg.rollout.agent, cfg.rollout.gconfig, tokenizer, reward_pool, reward_fn)

        async def arun_episode(self, engine, data):
            ...                                     # engine.agenerate(ModelRequest(...)) per turn
            return trajectory                       # or a list, when one episode makes several

`data`, one record of the data set (data/datasets.py) plus what the rollout adds:
    prompt_id       stable id of the prompt; trajectories of one prompt share it as `group_id` (the GRPO group)
    messages        the prompt as chat messages [{"role", "content"}]
    answer          the reference answer (a string, or a list of accepted strings for search QA)
    question        the question alone, without the system prompt or template
    sample_idx      the episode's index in its group, 0 .. n_samples - 1
    sampling_seed   optional: the episode's own seed, for its generations (`rlvr.sample_seed(data, turn)`), so a
                    rerun reproduces its shards

`engine` (inference/client.py) generates: `await engine.agenerate(ModelRequest(rid, input_ids, sampling))` (the
sampling: `SamplingParams.from_config(cfg.rollout.gconfig)`, inference/types.py) returns a `ModelResponse` whose output tokens, logprobs and policy versions go into the
trajectory unchanged; requests of one episode share a `rid` (one server keeps its prefix cached); `agenerate_group(requests)` sends several in one call.
The requests a group's episodes make in the same turn of the event loop go to the server together.

An episode returns a `Trajectory` (data/trajectory.py), or a list of them where one episode makes several (an OpenAI
agent's separate conversations): the exact ids the model was conditioned on and generated (`SequenceBuilder` grows
them turn by turn), `loss_mask` 1 on generated tokens, their logprobs and versions, the reward, and `metadata`, whose
numeric values are averaged into the iteration's metrics as `agent/<key>`. `token_returns`, when set, replaces the
reward per token in the advantages step (multi_turn's discounted per-turn returns). How rewards become advantages is
the algorithm's, not the workflow's: `ppo.advantage` (training/advantage_registry.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional, Protocol, runtime_checkable

if TYPE_CHECKING:
    from areal_pipeline.config import ExperimentConfig
    from areal_pipeline.data.trajectory import Trajectory
    from areal_pipeline.rewards.pool import RewardPool


@runtime_checkable
class RolloutWorkflow(Protocol):
    # `from_config` and `arun_episode` are required; a class without `config_class`, `reward_function` or `tools`
    # has None, None and () (`workflows.workflow_class` checks a class when the config names it).
    #
    # The dataclass of the workflow's `rollout.agent` section (its keys, defaults, comments as help, and optional
    # ClassVar `field_rules`: field -> config.Rule), or None for none. The run's `cfg.rollout.agent` is an instance.
    config_class: ClassVar[Optional[type]]
    # "module:attr" of the reward function `reward(completion: str, answer) -> float` the run's reward pool runs
    # (a subprocess with a time limit: math verification can hang), or None when the workflow scores in process.
    reward_function: ClassVar[Optional[str]]
    # Names of the tool servers the run starts before the first rollout (tools/__init__.py: TOOL_SERVERS); their
    # addresses reach `from_config` as `tool_addresses`.
    tools: ClassVar[tuple[str, ...]]

    @classmethod
    def from_config(cls, cfg: "ExperimentConfig", tokenizer, reward_pool: "RewardPool", *,
                    reward_fn: Optional[Callable[..., float]], tool_addresses: dict[str, str]) -> "RolloutWorkflow":
        """The workflow of the run `cfg`: `reward_fn` is `reward_function` loaded, `tool_addresses` maps each
        of `tools` to the host:port of its running server (empty when none was started, e.g. in tests)."""
        ...

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> "Trajectory | list[Trajectory]":
        """One episode of the prompt `data`, as its trajectory (or its trajectories)."""
        ...
