"""Advantage pipeline on small cases whose numbers are worked out by hand in the comments."""

import math

import pytest
import torch

from areal_pipeline.config import NormConfig, PPOConfig
from areal_pipeline.training.advantages import (
    advantage_stats,
    compute_advantages,
    discounted_advantages,
    kl_estimate,
    normalize_advantages,
    normalize_rewards,
    token_rewards,
    transform_rewards,
)

approx = lambda x: pytest.approx(x, rel=1e-4, abs=1e-5)  # noqa: E731


def close(t, expected):
    torch.testing.assert_close(t, torch.tensor(expected, dtype=t.dtype), rtol=1e-4, atol=1e-5)

S = math.sqrt(0.5)  # 0.7071


def test_transform_rewards_bias_scale_clip():
    # (-3 + 1) * 2 = -4; (0.5 + 1) * 2 = 3; (10 + 1) * 2 = 22 -> clipped to 5
    out = transform_rewards(torch.tensor([-3.0, 0.5, 10.0]), bias=1.0, scaling=2.0, clip=5.0)
    assert out.tolist() == [-4.0, 3.0, 5.0]


# Two groups of two: group 0 = {1, 0}, group 1 = {3, 3}.
R = torch.tensor([1.0, 0.0, 3.0, 3.0])
G = torch.tensor([0, 0, 1, 1])


@pytest.mark.parametrize(
    "cfg, expected",
    [
        # group 0: mean 0.5, unbiased std sqrt((0.25 + 0.25) / 1) = 0.7071 -> +-0.5 / 0.7071 = +-0.7071
        # group 1: mean 3, std 0 -> 0 / eps = 0
        (NormConfig("group", "group"), [S, -S, 0.0, 0.0]),
        # batch: mean 7/4 = 1.75, deviations -0.75, -1.75, 1.25, 1.25,
        # std = sqrt((0.5625 + 3.0625 + 1.5625 + 1.5625) / 3) = sqrt(2.25) = 1.5
        (NormConfig("batch", "batch"), [-0.5, -1.75 / 1.5, 1.25 / 1.5, 1.25 / 1.5]),
        # centring only
        (NormConfig("group", "none"), [0.5, -0.5, 0.0, 0.0]),
        # scaling only by the batch std 1.5
        (NormConfig("none", "batch"), [1 / 1.5, 0.0, 2.0, 2.0]),
        # RLOO within a group of two: the baseline is the other sample: 1 - 0, 0 - 1, 3 - 3, 3 - 3
        (NormConfig("group", "none", mean_leave_one_out=True), [1.0, -1.0, 0.0, 0.0]),
        # RLOO over the batch: baseline_i = (7 - r_i) / 3 = 2, 7/3, 4/3, 4/3
        (NormConfig("batch", "none", mean_leave_one_out=True), [1 - 2, 0 - 7 / 3, 3 - 4 / 3, 3 - 4 / 3]),
        # RLOO then the group std: group 0 -> +-1 / 0.7071 = +-1.4142
        (NormConfig("group", "group", mean_leave_one_out=True), [1 / S, -1 / S, 0.0, 0.0]),
    ],
)
def test_normalize_rewards(cfg, expected):
    assert normalize_rewards(R, G, cfg).tolist() == approx(expected)


def test_rloo_group_of_three():
    # baselines: (0 + 0) / 2 = 0, (1 + 0) / 2 = 0.5, 0.5 -> 1, -0.5, -0.5
    out = normalize_rewards(torch.tensor([1.0, 0.0, 0.0]), torch.tensor([7, 7, 7]), NormConfig("group", "none", True))
    assert out.tolist() == approx([1.0, -0.5, -0.5])


@pytest.mark.parametrize("loo", [False, True])
def test_singleton_group_is_zero_not_nan(loo):
    # group 5 = {4} alone: its baseline is itself, its std 0 -> 0, never 4 / eps or nan
    out = normalize_rewards(torch.tensor([4.0, 1.0, 0.0]), torch.tensor([5, 2, 2]), NormConfig("group", "group", loo))
    assert torch.isfinite(out).all()
    assert out[0].item() == 0.0


def test_normalize_rewards_rejects_bad_levels():
    with pytest.raises(ValueError, match="group_ids"):
        normalize_rewards(R, None, NormConfig("group", "none"))
    with pytest.raises(ValueError, match="mean_level"):
        normalize_rewards(R, G, NormConfig("prompt", "none"))


def test_kl_estimators():
    logp = torch.tensor([-1.0, -2.0, -0.5])
    ref = torch.tensor([-2.0, -1.0, -0.5])
    # k1 = logp - ref = 1, -1, 0
    assert kl_estimate(logp, ref, "k1").tolist() == approx([1.0, -1.0, 0.0])
    # k2 = 0.5 * (logp - ref)^2 = 0.5, 0.5, 0
    assert kl_estimate(logp, ref, "k2").tolist() == approx([0.5, 0.5, 0.0])
    # k3 with d = ref - logp = -1, 1, 0: exp(d) - d - 1 = e^-1, e - 2, 0
    assert kl_estimate(logp, ref, "k3").tolist() == approx([math.exp(-1), math.e - 2, 0.0])
    # k3 is bounded: d = 100 would overflow; AReaL clamps d to 20 and the value to 10
    assert kl_estimate(torch.tensor([-100.0]), torch.tensor([0.0]), "k3").item() == 10.0
    with pytest.raises(ValueError, match="k1"):
        kl_estimate(logp, ref, "low_var")


# prompt, prompt, gen, gen, env (tool output), gen, pad
MASK = torch.tensor(
    [
        [0, 0, 1, 1, 0, 1, 0],
        [0, 1, 1, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0, 0],  # nothing generated
    ],
    dtype=torch.float32,
)


@pytest.mark.parametrize("mask_no_eos", [False, True])
def test_token_rewards_on_last_generated_token(mask_no_eos):
    task = torch.tensor([1.0, 2.0, 3.0])
    kl = torch.full((3, 7), 0.5)
    no_eos = torch.tensor([False, True, False])
    out = token_rewards(task, kl, MASK, kl_ctl=0.1, no_eos=no_eos, mask_no_eos_with_zero=mask_no_eos)
    k = -0.1 * 0.5  # -0.05 on every generated token, nothing elsewhere
    # row 0: the last generated token is index 5, after the environment token at 4
    assert out[0].tolist() == approx([0, 0, k, k, 0, k + 1.0, 0])
    # row 1 was truncated (no EOS): its task reward is dropped when mask_no_eos_with_zero
    assert out[1].tolist() == approx([0, k, k + (0.0 if mask_no_eos else 2.0), 0, 0, 0, 0])
    # row 2 has no generated token: no place for a reward
    assert out[2].tolist() == [0.0] * 7


def test_gae_skips_masked_tokens():
    # prompt, gen, gen, env, gen, pad. Rewards/values on masked positions (100, 7) must be ignored.
    mask = torch.tensor([[0, 1, 1, 0, 1, 0]] * 2, dtype=torch.float32)
    rewards = torch.tensor([[0, 1.0, 0, 100.0, 2.0, 0]] * 2)
    values = torch.tensor([[0, 0.5, 1.0, 7.0, 1.0, 0], [0.0] * 6])
    adv, ret = discounted_advantages(rewards, values, mask, discount=0.5, gae_lambda=0.5)
    # gamma = lambda = 0.5, gamma * lambda = 0.25; the next generated token after 2 is 4.
    # row 0, with values:
    #   t=4: delta = 2 + 0.5 * 0 - 1.0 = 1;               A = 1
    #   t=2: delta = 0 + 0.5 * V4 - V2 = 0.5 - 1 = -0.5;  A = -0.5 + 0.25 * 1 = -0.25
    #   t=1: delta = 1 + 0.5 * V2 - V1 = 1 + 0.5 - 0.5 = 1; A = 1 + 0.25 * -0.25 = 0.9375
    assert adv[0].tolist() == approx([0, 0.9375, -0.25, 0, 1.0, 0])
    assert ret[0].tolist() == approx([0, 0.9375 + 0.5, -0.25 + 1.0, 7.0, 2.0, 0])
    # row 1, values 0: A4 = 2; A2 = 0 + 0.25 * 2 = 0.5; A1 = 1 + 0.25 * 0.5 = 1.125
    assert adv[1].tolist() == approx([0, 1.125, 0.5, 0, 2.0, 0])


def test_gae_critic_free_grpo_broadcasts_the_outcome():
    # values=None, gamma = lambda = 1: every generated token's advantage is the final reward
    mask = torch.tensor([[0, 1, 1, 0, 1]], dtype=torch.float32)
    rewards = torch.tensor([[0, 0, 0, 0, 2.0]])
    adv, ret = discounted_advantages(rewards, None, mask, discount=1.0, gae_lambda=1.0)
    assert adv.tolist() == [[0, 2.0, 2.0, 0, 2.0]]
    assert torch.equal(ret, adv)


def test_normalize_advantages_ignores_masked_tokens():
    adv = torch.tensor([[9.0, 1.0, 3.0], [9.0, 5.0, 9.0]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 0]], dtype=torch.float32)
    # batch: the generated tokens are {1, 3, 5}: mean 3, unbiased std sqrt((4 + 0 + 4) / 2) = 2
    out = normalize_advantages(adv, mask, NormConfig("batch", "batch"))
    close(out, [[0, -1.0, 0], [0, 1.0, 0]])
    # group, rows in different groups: {1, 3}: mean 2, std sqrt(2) -> -+0.7071; {5} alone -> 0
    out = normalize_advantages(adv, mask, NormConfig("group", "group"), group_ids=torch.tensor([0, 1]))
    close(out, [[0, -S, S], [0, 0, 0]])


def test_compute_advantages_end_to_end():
    cfg = PPOConfig(
        reward_bias=-0.5,
        reward_scaling=2.0,
        reward_norm=NormConfig("group", "none"),
        adv_norm=NormConfig("none", "none"),
        kl_ctl=0.1,
        kl_estimator="k1",
    )
    mask = torch.tensor([[0, 1, 1]] * 4, dtype=torch.float32)
    batch = {
        "rewards": torch.tensor([1.0, 0.0, 1.0, 1.0]),
        "group_ids": torch.tensor([0, 0, 1, 1]),
        "loss_mask": mask,
        "logprobs": torch.tensor([[0, -1.0, -1.0]] * 4),
        "ref_logprobs": torch.tensor([[0, -1.5, -1.0]] * 4),
    }
    out = compute_advantages(batch, cfg)
    # task: (r - 0.5) * 2 = 1, -1, 1, 1; minus the group mean (0, 0, 1, 1) = 1, -1, 0, 0
    assert out["task_rewards"].tolist() == approx([1.0, -1.0, 0.0, 0.0])
    # k1 = logp - ref = 0.5 at t=1, 0 at t=2
    close(out["kl"], [[0, 0.5, 0]] * 4)
    # token rewards: -0.1 * 0.5 = -0.05 at t=1, the task reward at t=2
    assert out["token_rewards"][0].tolist() == approx([0, -0.05, 1.0])
    # gamma = lambda = 1, no critic: A_2 = task, A_1 = -0.05 + task
    close(out["advantages"], [[0, 0.95, 1.0], [0, -1.05, -1.0], [0, -0.05, 0], [0, -0.05, 0]])
    assert torch.equal(out["returns"], out["advantages"])
    assert out["rewards"] is batch["rewards"]  # the inputs are kept

    stats = advantage_stats(out)
    # raw rewards 1, 0, 1, 1: mean 0.75, population std sqrt((3 * 0.0625 + 0.5625) / 4) = 0.4330
    # kl over the 8 generated tokens: (4 * 0.5) / 8 = 0.25
    assert stats["reward_mean"] == approx(0.75)
    assert stats["reward_std"] == approx(math.sqrt(0.1875))
    assert stats["advantage_min"] == approx(-1.05) and stats["advantage_max"] == approx(1.0)
    assert stats["kl_mean"] == approx(0.25)
    assert set(stats) == {"reward_mean", "reward_std", "advantage_mean", "advantage_std",
                          "advantage_min", "advantage_max", "kl_mean"}
    assert all(isinstance(v, float) for v in stats.values())


def test_compute_advantages_grpo_defaults():
    # The default config: group mean/std rewards, batch-normalised token advantages.
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 1, 1], [0, 1, 0, 0], [0, 1, 1, 0]], dtype=torch.float32)
    batch = {
        "rewards": torch.tensor([1.0, 0.0, 1.0, 1.0]),
        "group_ids": torch.tensor([3, 3, 8, 8]),
        "loss_mask": mask,
        "logprobs": -torch.rand(4, 4) * mask,
        "no_eos": torch.tensor([False, False, True, False]),
    }
    out = compute_advantages(batch, PPOConfig())
    # group 0: +-0.7071 (see test_normalize_rewards); group 1: equal rewards -> 0
    assert out["task_rewards"].tolist() == approx([S, -S, 0.0, 0.0])
    adv = out["advantages"][mask.bool()]
    assert adv.mean().item() == approx(0.0) and adv.std().item() == approx(1.0)
    assert (out["advantages"][~mask.bool()] == 0).all()
    with pytest.raises(ValueError, match="ref_logprobs"):
        compute_advantages(batch, PPOConfig(kl_ctl=0.1))


def test_compute_batch_lays_ragged_rows_out_as_compute_advantages_sees_them():
    """The batch table's per-token columns are compute_advantages' output row by row, cut to each row's
    length; groups are numbered in order of first appearance and only "stop" ends count as EOS."""
    import pyarrow as pa

    from areal_pipeline.training.batches import compute_batch, pad

    rows = [  # (group, input_ids, loss_mask, logprobs, reward, stop_reason)
        ("b", [1, 2, 3], [0, 1, 1], [0.0, -0.5, -1.0], 1.0, "stop"),
        ("a", [1, 2, 3, 4, 5], [0, 0, 1, 1, 1], [0.0, 0.0, -0.2, -0.3, -0.4], 0.0, "length"),
        ("b", [1, 2], [0, 1], [0.0, -2.0], 0.0, "stop"),
        ("a", [7], [0], [0.0], 1.0, "stop"),
    ]
    group, ids, mask, logp, reward, stop = (list(c) for c in zip(*rows))
    rollout = pa.table({"group_id": group, "input_ids": ids, "loss_mask": mask,
                        "logprobs": pa.array(logp, type=pa.list_(pa.float32())), "reward": reward,
                        "stop_reason": stop})
    cfg = PPOConfig(mask_no_eos_with_zero=True)
    table, stats = compute_batch(rollout, cfg)

    expected = compute_advantages({
        "rewards": torch.tensor(reward), "loss_mask": pad(mask, 5), "logprobs": pad(logp, 5),
        "group_ids": torch.tensor([0, 1, 0, 1]), "no_eos": torch.tensor([False, True, False, False])}, cfg)
    for name in ("advantages", "returns", "token_rewards", "kl"):
        got = table.column(name).to_pylist()
        assert [len(r) for r in got] == [3, 5, 2, 1]
        for i, row in enumerate(got):
            assert row == pytest.approx(expected[name][i, : len(row)].tolist(), abs=1e-7), (name, i)
    assert table.column("task_reward").to_pylist() == pytest.approx(expected["task_rewards"].tolist(), abs=1e-7)
    assert stats == pytest.approx(advantage_stats(expected))
    # the no-EOS row's reward was masked to zero: its advantages are those of a zero reward
    assert table.column("token_rewards").to_pylist()[1] == [0.0] * 5
    # rollouts read from several shards come as several chunks: the same batch
    chunked, _ = compute_batch(pa.concat_tables([rollout.slice(0, 1), rollout.slice(1)]), cfg)
    for name in ("advantages", "returns", "token_rewards", "kl", "task_reward"):
        assert chunked.column(name).to_pylist() == table.column(name).to_pylist(), name


# ---------------------------------------------------------------------------------------------- ppo.advantage


def _rows(rewards, group_ids, width=3, **extra):
    """Rows of one prompt token and `width - 1` generated ones."""
    n = len(rewards)
    mask = torch.tensor([[0.0] + [1.0] * (width - 1)] * n)
    return {"rewards": torch.tensor(rewards), "loss_mask": mask, "logprobs": -0.5 * mask,
            "group_ids": torch.tensor(group_ids), "no_eos": torch.zeros(n, dtype=torch.bool), **extra}


def test_the_default_advantage_is_grpo_and_remax_subtracts_the_greedy_reward():
    from areal_pipeline.training.advantage_registry import ADVANTAGES, Advantage, make_advantage

    assert list(ADVANTAGES) == ["grpo", "remax", "gigpo"] and PPOConfig().advantage == "grpo"
    batch = _rows([1.0, 0.0, 0.0, 0.0], [0, 0, 1, 1])
    grpo = make_advantage(PPOConfig())
    assert isinstance(grpo, Advantage) and not grpo.greedy_baseline
    close(grpo.fn(batch)["advantages"], compute_advantages(batch, PPOConfig())["advantages"].tolist())

    raw = PPOConfig(advantage="remax", loss="reinforce", reward_bias=5.0, reward_scaling=3.0,
                    adv_norm=NormConfig(mean_level="none", std_level="none"))
    remax = make_advantage(raw)
    assert remax.greedy_baseline
    out = remax.fn({**batch, "baseline_rewards": torch.tensor([1.0, 1.0, 0.0, 1.0])})
    # reward - its prompt's greedy reward on every generated token, unshaped: 0, -1, 0, -1
    close(out["advantages"], [[0, 0, 0], [0, -1, -1], [0, 0, 0], [0, -1, -1]])
    close(out["task_rewards"], [1.0, 0.0, 0.0, 0.0])  # the raw rewards
    # the configured advantage normalisation still applies (batch mean -0.5, std over the 8 generated tokens)
    normed = make_advantage(PPOConfig(advantage="remax")).fn({**batch, "baseline_rewards": torch.ones(4)})
    close(normed["advantages"][:, 1:], normalize_advantages(
        torch.tensor([[0.0, 0.0]] + [[-1.0, -1.0]] * 3), torch.ones(4, 2), PPOConfig().adv_norm).tolist())
    with pytest.raises(ValueError, match="ppo.advantage=remax needs each trajectory's baseline_reward"):
        remax.fn(batch)
    with pytest.raises(ValueError, match="ppo.advantage=remax takes one reward per trajectory"):
        remax.fn({**batch, "baseline_rewards": torch.ones(4), "token_returns": torch.ones(4, 3)})


def test_an_advantage_of_your_own_from_a_file(tmp_path):
    from areal_pipeline.config import ConfigError
    from areal_pipeline.run_spec import load_config
    from areal_pipeline.data.shards import read_table, write_shards
    from areal_pipeline.data.trajectory import Trajectory
    from areal_pipeline.training.advantage_registry import make_advantage
    from areal_pipeline.training.batches import compute_batch

    (tmp_path / "mine.py").write_text(
        "from areal_pipeline.training.advantage_registry import Advantage\n"
        "from areal_pipeline.training.advantages import compute_advantages\n\n"
        "def doubled(ppo_cfg):\n"
        "    def fn(batch):\n"
        "        out = compute_advantages(batch, ppo_cfg)\n"
        "        return {**out, 'advantages': 2 * out['advantages']}\n"
        "    return Advantage(fn)\n\n"
        "def no_advantage(ppo_cfg):\n"
        "    return 'not an Advantage'\n\n"
        "def forgetful(ppo_cfg):\n"
        "    return Advantage(lambda batch: {**batch, 'advantages': batch['loss_mask']})\n")
    cfg = load_config(None, [f"ppo.advantage={tmp_path / 'mine.py'}:doubled"])
    trajectories = [Trajectory(prompt_id="p", group_id="p", sample_idx=i, input_ids=[1, 2, 3], loss_mask=[0, 1, 1],
                               logprobs=[0.0, -0.5, -0.5], versions=[-1, 0, 0], reward=r, stop_reason="stop")
                    for i, r in enumerate([1.0, 0.0])]
    write_shards(trajectories, tmp_path / "rollout", run_id="r", iteration=1)
    rollout = read_table(tmp_path / "rollout")
    mine, _ = compute_batch(rollout, cfg.ppo)
    grpo, _ = compute_batch(rollout, load_config().ppo)
    assert mine.column("advantages").to_pylist() == [[2 * a for a in row] for row in grpo.column("advantages").to_pylist()]
    with pytest.raises(ConfigError, match=r"ppo.advantage='.*mine.py:nothing': must be grpo, remax, gigpo, or 'module:attr'"):
        load_config(None, [f"ppo.advantage={tmp_path / 'mine.py'}:nothing"])
    with pytest.raises(TypeError, match=r"its builder returned str, not an advantage_registry.Advantage"):
        make_advantage(load_config(None, [f"ppo.advantage={tmp_path / 'mine.py'}:no_advantage"]).ppo)
    with pytest.raises(ValueError, match=r"returned no returns, token_rewards, kl, task_rewards"):
        compute_batch(rollout, load_config(None, [f"ppo.advantage={tmp_path / 'mine.py'}:forgetful"]).ppo)
