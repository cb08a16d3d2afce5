"""Policy losses on tokens whose ratios and advantages put them in each clipping regime; the
expected values are worked out by hand in the comments."""

import math

import pytest
import torch

from areal_pipeline.training.losses import entropy_from_logits, gather_logprobs, ppo_actor_loss, reinforce_loss

approx = lambda x: pytest.approx(x, rel=1e-4, abs=1e-6)  # noqa: E731
log = math.log


def close(t, expected):
    torch.testing.assert_close(t, torch.tensor(expected, dtype=t.dtype), rtol=1e-4, atol=1e-6)


def ppo(ratios, advantages, mask=None, **kwargs):
    """Loss and stats for tokens with old logprob 0 and the given ratios (logp = log ratio)."""
    logp = torch.tensor([log(r) for r in ratios], requires_grad=True)
    mask = torch.ones(len(ratios)) if mask is None else torch.tensor(mask, dtype=torch.float32)
    kwargs.setdefault("eps_clip", 0.2)
    loss, stats = ppo_actor_loss(logp, torch.zeros(len(ratios)), torch.tensor(advantages), mask, **kwargs)
    loss.backward()
    return loss, stats, logp.grad


@pytest.mark.parametrize(
    "ratio, adv, expected, clipped",
    [
        (1.1, 1.0, -1.1, False),  # inside [0.8, 1.2]: -A * r
        (1.5, 1.0, -1.2, True),  # above 1 + eps with A > 0: max(-1.5, -1.2) = -1.2
        (0.5, -1.0, 0.8, True),  # below 1 - eps with A < 0: max(0.5, 0.8) = 0.8
        (0.5, 1.0, -0.5, False),  # below 1 - eps with A > 0: max(-0.5, -0.8) = -0.5, unclipped
        (1.5, -1.0, 1.5, False),  # above 1 + eps with A < 0: max(1.5, 1.2) = 1.5, unclipped
    ],
)
def test_ppo_clip_regimes(ratio, adv, expected, clipped):
    loss, stats, grad = ppo([ratio], [adv])
    assert loss.item() == approx(expected)
    assert stats["clip_fraction"].item() == float(clipped)
    # d(-A r)/d logp = -A r where unclipped; a clipped token has no gradient
    assert grad.item() == approx(0.0 if clipped else -adv * ratio)


def test_ppo_is_a_token_mean_and_masked_tokens_count_for_nothing():
    # the first four cases above, plus a masked token with an absurd ratio and advantage
    loss, stats, grad = ppo([1.1, 1.5, 0.5, 0.5, 1e6], [1.0, 1.0, -1.0, 1.0, -1e6], mask=[1, 1, 1, 1, 0])
    # (-1.1 - 1.2 + 0.8 - 0.5) / 4 = -0.5
    assert loss.item() == approx(-0.5)
    assert stats["clip_fraction"].item() == approx(0.5)  # 2 of the 4 counted tokens
    # importance weight (1.1 + 1.5 + 0.5 + 0.5) / 4 = 0.9; approx_kl = mean log ratio
    assert stats["importance_weight"].item() == approx(0.9)
    assert stats["approx_kl"].item() == approx((log(1.1) + log(1.5) + 2 * log(0.5)) / 4)
    # gradients: -A r / 4 on unclipped tokens: -1.1/4, 0, 0, -0.5/4, and 0 on the masked one
    close(grad, [-0.275, 0.0, 0.0, -0.125, 0.0])
    assert all(not s.requires_grad for s in stats.values())


def test_dual_clip_bounds_negative_advantages():
    # c_clip = 3:
    #   A = -1, r = 10: standard loss max(10, 1.2) = 10 -> min(10, 3 * 1) = 3, no gradient
    #   A = +1, r = 10: max(-10, -1.2) = -1.2; the dual clip only touches A < 0
    #   A = -1, r = 2: max(2, 1.2) = 2 < 3, left alone
    loss, stats, grad = ppo([10.0, 10.0, 2.0], [-1.0, 1.0, -1.0], c_clip=3.0)
    assert loss.item() == approx((3.0 - 1.2 + 2.0) / 3)
    assert stats["dual_clip_fraction"].item() == approx(1 / 3)
    assert stats["clip_fraction"].item() == approx(1 / 3)  # the A > 0 token
    close(grad, [0.0, 0.0, 2.0 / 3])  # -A r / 3 on the last token only
    with pytest.raises(ValueError, match="c_clip"):
        ppo([1.0], [1.0], c_clip=1.0)


def test_eps_clip_higher_widens_only_the_upper_side():
    # eps = 0.2, eps_higher = 0.28: range [0.8, 1.28]
    #   r = 1.25, A = 1: inside -> -1.25 (the symmetric range would clip it to -1.2)
    #   r = 0.75, A = -1: below 0.8 -> max(0.75, 0.8) = 0.8, clipped either way
    loss, stats, _ = ppo([1.25, 0.75], [1.0, -1.0], eps_clip_higher=0.28)
    assert loss.item() == approx((-1.25 + 0.8) / 2)
    assert stats["clip_fraction"].item() == approx(0.5)
    loss, _, _ = ppo([1.25, 0.75], [1.0, -1.0])
    assert loss.item() == approx((-1.2 + 0.8) / 2)


def test_decoupled_loss_uses_the_proximal_policy_and_caps_the_behaviour_weight():
    # per token: behaviour (old) prob, proximal prob, current prob, advantage
    #   t0: old 0.5,  prox 1, cur 1.1, A = 1:  ratio 1.1/1 = 1.1 (inside), w = 1/0.5 = 2 -> -1.1 * 2 = -2.2
    #   t1: old 0.25, prox 1, cur 1,   A = 1:  w = 4 > cap 3 -> dropped (0)
    #   t2: old 1,    prox 1, cur 1,   A = -1: ratio 1, w = 1 -> 1.0
    #   t3: masked, absurd numbers everywhere
    # Against `old` t0's ratio would be 2.2 and clipped: the ratio must use prox.
    logp = torch.tensor([log(1.1), 0.0, 0.0, 1e4], requires_grad=True)
    old = torch.tensor([log(0.5), log(0.25), 0.0, -1e4])
    prox = torch.tensor([0.0, 0.0, 0.0, 1e4])
    adv = torch.tensor([1.0, 1.0, -1.0, 1e4])
    mask = torch.tensor([1, 1, 1, 0])
    loss, stats = ppo_actor_loss(logp, old, adv, mask, eps_clip=0.2, proximal_logprobs=prox, behav_imp_weight_cap=3.0)
    loss.backward()
    # (-2.2 + 0 + 1.0) / 3: the dropped token still counts in the mean, as in AReaL
    assert loss.item() == approx(-0.4)
    assert stats["behave_imp_weight"].item() == approx((2 + 1) / 2)  # over the kept tokens
    assert stats["behave_mask_fraction"].item() == approx(1 / 3)
    assert stats["importance_weight"].item() == approx((1.1 + 1 + 1) / 3)
    assert stats["approx_kl"].item() == approx(log(1.1) / 3)
    # d/d logp_t0 of -A * w * r / 3 = -1 * 2 * 1.1 / 3; t1 dropped; t2: -(-1) * 1 * 1 / 3
    close(logp.grad, [-2.2 / 3, 0.0, 1 / 3, 0.0])
    # without proximal logprobs there is no behaviour weight and no such stats
    _, stats = ppo_actor_loss(logp, old, adv, mask, eps_clip=0.2)
    assert "behave_imp_weight" not in stats


def test_gspo_sequence_ratio_on_packed_sequences():
    # packed: [prompt, a, b | c, d, e]; log ratios (old = 0) and advantages per token
    #   seq 0: masked prompt (log ratio 5, A 100), then 0.1, 0.3 -> mean 0.2, s0 = exp(0.2) = 1.2214
    #          A = mean(0.5, 1.5) = 1 > 0 and s0 > 1.2 -> clipped: -1.2 on each of its 2 tokens
    #   seq 1: -0.1, 0.0, -0.2 -> mean -0.1, s1 = exp(-0.1) = 0.9048, A = -1, inside -> 0.9048 x 3
    logp = torch.tensor([5.0, 0.1, 0.3, -0.1, 0.0, -0.2], requires_grad=True)
    adv = torch.tensor([100.0, 0.5, 1.5, -1.0, -1.0, -1.0])
    mask = torch.tensor([0, 1, 1, 1, 1, 1])
    seq_ids = torch.tensor([4, 4, 4, 9, 9, 9])
    loss, stats = ppo_actor_loss(logp, torch.zeros(6), adv, mask, eps_clip=0.2,
                                 importance_sampling_level="sequence", seq_ids=seq_ids)
    loss.backward()
    s1 = math.exp(-0.1)
    assert loss.item() == approx((2 * -1.2 + 3 * s1) / 5)
    assert stats["clip_fraction"].item() == approx(2 / 5)
    assert stats["importance_weight"].item() == approx((2 * math.exp(0.2) + 3 * s1) / 5)
    # seq 1's loss is 3 * s1 / 5 and d s1 / d logp_t = s1 / 3, so each of its tokens gets s1 / 5;
    # seq 0 is clipped and the prompt is masked: no gradient
    close(logp.grad, [0.0, 0.0, 0.0, s1 / 5, s1 / 5, s1 / 5])

    # the same two sequences padded to [2, 3]: rows are the sequences by default
    padded = ppo_actor_loss(logp.detach().view(2, 3), torch.zeros(2, 3), adv.view(2, 3),
                            mask.view(2, 3), eps_clip=0.2, importance_sampling_level="sequence")[0]
    assert padded.item() == approx(loss.item())
    with pytest.raises(ValueError, match="seq_ids"):
        ppo_actor_loss(logp, torch.zeros(6), adv, mask, eps_clip=0.2, importance_sampling_level="sequence")


def test_reinforce():
    logp = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    adv = torch.tensor([1.0, -2.0, 5.0])
    loss, stats = reinforce_loss(logp, adv, torch.tensor([1, 1, 0]))
    loss.backward()
    # (-(1 * -1) - (-2 * -2)) / 2 = (1 - 4) / 2 = -1.5; the masked third token is ignored
    assert loss.item() == approx(-1.5)
    close(logp.grad, [-0.5, 1.0, 0.0])  # -A / 2
    assert stats["logprob"].item() == approx(-1.5) and stats["advantage"].item() == approx(-0.5)


def test_gather_logprobs():
    # softmax([0, log 3]) = [0.25, 0.75]; at temperature 2: [0, log sqrt 3] -> p0 = 1 / (1 + sqrt 3)
    logits = torch.tensor([[0.0, log(3)]])
    assert gather_logprobs(logits, torch.tensor([1])).item() == approx(log(0.75))
    assert gather_logprobs(logits, torch.tensor([0]), temperature=2.0).item() == approx(-log(1 + math.sqrt(3)))

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 7, requires_grad=True)
    labels = torch.randint(0, 7, (2, 5))
    out = gather_logprobs(logits, labels, chunk_size=3)  # chunks split the rows: 10 tokens as 3+3+3+1
    assert out.shape == (2, 5)
    torch.testing.assert_close(out, torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0])
    # d log p_label / d logits = onehot(label) - softmax
    out.sum().backward()
    torch.testing.assert_close(logits.grad, torch.nn.functional.one_hot(labels, 7) - torch.softmax(logits, -1))


def test_gather_logprobs_with_shared_rows_and_temperature_has_autograds_gradient():
    """Labels read from shared rows (`rows`), at a temperature: values and gradients are those of the plain
    log-softmax through autograd."""
    torch.manual_seed(1)
    logits = torch.randn(4, 9, dtype=torch.float64, requires_grad=True)
    rows, labels = torch.tensor([0, 0, 1, 3, 3, 3]), torch.tensor([2, 5, 8, 0, 1, 2])
    out = gather_logprobs(logits, labels, temperature=0.7, chunk_size=3, rows=rows)
    reference_logits = logits.detach().clone().requires_grad_(True)
    reference = torch.log_softmax(reference_logits / 0.7, -1)[rows, labels]
    torch.testing.assert_close(out, reference.float())
    weights = torch.arange(1.0, 7.0, dtype=torch.float64)
    (out.double() * weights).sum().backward()
    (reference * weights).sum().backward()
    torch.testing.assert_close(logits.grad, reference_logits.grad, rtol=1e-5, atol=1e-6)  # float32 inside


def test_gather_logprobs_keeps_only_the_logits_for_backward():
    """What autograd saves for the backward of bfloat16 logits' logprobs: the logits themselves and per-token
    vectors, never a float32 [N, V] (the chunks' float32 copies and log-softmax), which is what ran a 0.5B model's
    update out of memory on an 80 GB GPU."""
    n, vocab = 64, 1000
    logits = torch.randn(n, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (n,))
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = gather_logprobs(logits * 1, labels, chunk_size=16)
    over_vocab = [(tuple(t.shape), t.dtype) for t in saved if t.dim() and t.shape[-1] == vocab]
    assert over_vocab and all(dtype == torch.bfloat16 for _, dtype in over_vocab), over_vocab
    out.sum().backward()
    expected = torch.nn.functional.one_hot(labels, vocab) - torch.softmax(logits.detach().float(), -1)
    torch.testing.assert_close(logits.grad.float(), expected, atol=1e-2, rtol=0)


def test_entropy_from_logits():
    # uniform over 4: log 4; p = [0.5, 0.25, 0.25]: 0.5 log 2 + 2 * 0.25 log 4 = 1.5 log 2;
    # a -inf logit has p = 0 and adds nothing (not nan)
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [log(2), 0.0, 0.0, -math.inf]])
    close(entropy_from_logits(logits, chunk_size=1), [log(4), 1.5 * log(2)])


def test_logprobs_and_entropy_in_one_pass_compiled_or_not():
    """The trainer's per-token logprob (with its gradient) and entropy from one pass over each chunk: equal to
    log-softmax's; and the same through the torch.compile'd kernels the trainer uses on CUDA (compiled here on
    the CPU: the same code, generated for another device), over chunks that split the rows unevenly."""
    from areal_pipeline.training import losses

    torch.manual_seed(0)
    logits = torch.randn(37, 50, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 50, (37,))
    rows = torch.tensor([0, 0, 1, 2, 5, 36])  # tokens reading shared rows

    def run():
        logp, entropy = losses.logprobs_and_entropy(logits, labels[rows], 0.7, chunk_size=8, rows=rows)
        (grad,) = torch.autograd.grad((logp * torch.linspace(-1, 1, len(rows))).sum(), logits)
        return logp.detach(), entropy, grad

    reference = torch.log_softmax(logits.detach().double() / 0.7, -1)
    logp, entropy, grad = run()
    torch.testing.assert_close(logp.double(), reference[rows, labels[rows]], rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), -(reference.exp() * reference).sum(-1)[rows], rtol=0, atol=1e-5)
    try:
        losses.use_compiled_vocab_kernels(True)
        compiled = run()
        assert losses.VOCAB_KERNELS.compiled  # not fallen back to eager
    finally:
        losses.use_compiled_vocab_kernels(False)
    for eager, fused in zip((logp, entropy, grad), compiled):
        torch.testing.assert_close(fused.float(), eager.float(), rtol=0, atol=1e-5)
