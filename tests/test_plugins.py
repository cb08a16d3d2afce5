"""Extension points: a loss of the user's own, in a module outside the package, named in the config
(`ppo.loss=module:attr`) and trained with through the flow; a workflow of the user's own, in a file outside the
package with its own config section (`rollout.workflow=path/to/file.py:Class`, `rollout.agent.<its keys>`), trained
through the flow; and the config's refusals of what cannot be one."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from areal_pipeline.config import ConfigError

from areal_pipeline.data.shards import read_trajectories
from areal_pipeline.run_spec import load_config
from test_flows import cli, fast_overrides

USER_LOSS = '''
import os
from pathlib import Path

from areal_pipeline.training.loss_registry import Loss
from areal_pipeline.training.losses import reinforce_loss


def clipped_reinforce(ppo_cfg) -> Loss:
    """REINFORCE on advantages clipped to [-0.5, 0.5]; it tells the test, in a file, that the trainer built it and
    what each update's micro-batches saw."""
    marker = Path(os.environ["USER_LOSS_MARKER"])
    marker.write_text("built\\n")

    def fn(logprobs, entropy, mb):
        advantages = mb.tensors["advantages"]
        with marker.open("a") as out:
            out.write(f"{float(advantages.abs().max())}\\n")
        loss, stats = reinforce_loss(logprobs, advantages.clamp(-0.5, 0.5), mb.tensors["loss_mask"])
        return loss, {**stats, "clipped_advantage": advantages.clamp(-0.5, 0.5).abs().max().detach()}

    return Loss(fn, weight=lambda mb: float(mb.tensors["loss_mask"].sum()), columns=("loss_mask", "advantages"))
'''


def test_a_loss_from_the_users_own_module_trains_through_the_flow(prefect_api, tiny_model_dir, tmp_path):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "my_losses.py").write_text(textwrap.dedent(USER_LOSS))
    marker = tmp_path / "loss-calls.txt"
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "USER_LOSS_MARKER": str(marker),
           "PYTHONPATH": os.pathsep.join([str(plugins), os.environ.get("PYTHONPATH", "")])}
    run = cli("train", "--config", "configs/tiny_cpu.yaml", *fast_overrides(tmp_path, tiny_model_dir, run_id="own",
              iterations=2), "ppo.loss=my_losses:clipped_reinforce", "eval_freq=0", env=env)
    out, _ = run.communicate(timeout=600)
    assert run.returncode == 0, out[-3000:]
    lines = marker.read_text().splitlines()
    assert lines[0] == "built" and len(lines) > 2, lines  # built by the trainer, called on every micro-batch
    updates = [json.loads((tmp_path / "own" / f"iter_{k}" / "update.json").read_text()) for k in (1, 2)]
    assert [u["version"] for u in updates] == [1, 2]
    assert all(0 <= u["clipped_advantage"] <= 0.5 for u in updates), updates  # the loss's own stat, recorded


@pytest.mark.parametrize("loss", ["nope", "os:no_such_builder", "no_such_module_here:build"])
def test_a_loss_that_names_nothing_importable_is_refused_when_the_config_loads(loss):
    with pytest.raises(ConfigError, match=rf"ppo.loss='{loss}': must be ppo, reinforce, or 'module:attr'"):
        load_config("configs/tiny_cpu.yaml", [f"ppo.loss={loss}"])


USER_WORKFLOW = '''
import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from areal_pipeline.config import one_of
from areal_pipeline.workflows.rlvr import RLVRWorkflow


@dataclass
class HintConfig:
    # a sentence added to each question before the model answers it
    hint: str = "Answer with the number only."
    # where the hint goes: before | after the question
    position: str = "after"

    field_rules: ClassVar[dict] = {"position": one_of("before", "after")}


class HintedWorkflow:
    """RLVR on questions with the configured hint added; each trajectory records the hint it was asked with."""

    config_class = HintConfig
    reward_function = "areal_pipeline.rewards.math:math_reward"
    tools = ()

    def __init__(self, single_turn: RLVRWorkflow, hint: str, position: str):
        self.single_turn = single_turn
        self.hint, self.position = hint, position

    @classmethod
    def from_config(cls, cfg, tokenizer, reward_pool, *, reward_fn, tool_addresses):
        agent = cfg.rollout.agent
        return cls(RLVRWorkflow(reward_fn, cfg.rollout.gconfig, tokenizer, reward_pool), agent.hint, agent.position)

    async def arun_episode(self, engine, data):
        question = data["messages"][-1]
        parts = [self.hint, question["content"]] if self.position == "before" else [question["content"], self.hint]
        hinted = {**data, "messages": [*data["messages"][:-1], {**question, "content": " ".join(parts)}]}
        t = await self.single_turn.arun_episode(engine, hinted)  # one episode: the rollout plays the group
        return dataclasses.replace(t, metadata={**t.metadata, "hint": self.hint})
'''


def test_a_workflow_from_the_users_own_file_trains_through_the_flow(prefect_api, tiny_model_dir, tmp_path):
    plugins = tmp_path / "plugins"
    plugins.mkdir()
    (plugins / "hinted.py").write_text(textwrap.dedent(USER_WORKFLOW))
    workflow = f"rollout.workflow={plugins / 'hinted.py'}:HintedWorkflow"
    env = {**os.environ, "PREFECT_API_URL": prefect_api}
    run = cli("train", "--config", "configs/tiny_cpu.yaml", *fast_overrides(tmp_path, tiny_model_dir, run_id="hinted",
              iterations=2), workflow, "rollout.agent.hint=Be brief.", "eval_freq=0", env=env)
    out, _ = run.communicate(timeout=600)
    assert run.returncode == 0, out[-3000:]
    for k in (1, 2):
        trajectories = read_trajectories(tmp_path / "hinted" / f"iter_{k}" / "rollout")
        assert len(trajectories) == 16  # 4 prompts x 4 samples
        assert all(t.metadata["hint"] == "Be brief." for t in trajectories)  # its episodes, with its config
        assert all(t.messages[-2]["content"].endswith(" Be brief.") for t in trajectories)
    update = json.loads((tmp_path / "hinted" / "iter_2" / "update.json").read_text())
    assert update["version"] == 2


def test_a_workflow_of_the_users_own_takes_only_its_own_keys(tmp_path):
    (tmp_path / "hinted.py").write_text(textwrap.dedent(USER_WORKFLOW))
    workflow = f"rollout.workflow={tmp_path / 'hinted.py'}:HintedWorkflow"
    cfg = load_config("configs/tiny_cpu.yaml", [workflow, "rollout.agent.position=before"])
    assert type(cfg.rollout.agent).__name__ == "HintConfig" and cfg.rollout.agent.position == "before"
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout.agent.max_turns'.* Keys of workflow "
                                          r".*hinted.py:HintedWorkflow: rollout.agent.hint, rollout.agent.position"):
        load_config("configs/tiny_cpu.yaml", [workflow, "rollout.agent.max_turns=2"])
    with pytest.raises(ConfigError, match=r"rollout.agent.position='middle': must be one of before, after"):
        load_config("configs/tiny_cpu.yaml", [workflow, "rollout.agent.position=middle"])  # its own rules, at load
    with pytest.raises(ConfigError, match=r"has no 'Hinted'"):
        load_config("configs/tiny_cpu.yaml", [f"rollout.workflow={tmp_path / 'hinted.py'}:Hinted"])
    with pytest.raises(ConfigError, match=r"HintConfig is not a workflow class \(it has no from_config or "
                                          r"arun_episode"):
        load_config("configs/tiny_cpu.yaml", [f"rollout.workflow={tmp_path / 'hinted.py'}:HintConfig"])
