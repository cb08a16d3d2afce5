"""Extension points: a loss of the user's own, in a module outside the package, named in the config
(`ppo.loss=module:attr`) and trained with through the flow; and the config's refusals of what cannot be one."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from areal_pipeline.config import ConfigError, load_config
from test_flows import cli, fast_overrides, prefect_api  # noqa: F401  (the module's Prefect API fixture)

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
