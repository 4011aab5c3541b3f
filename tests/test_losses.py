"""Losses against hand-computed values and against exact references computed another way."""

import math

import pytest
import torch

from lopd import losses


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = losses.group_advantages(rewards, group, normalize_std=True, eps=0.0)
    # group 0: mean 1/3, unbiased std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    s = math.sqrt(1 / 3)
    expected = torch.tensor([(2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s, (-2 / 3) / s, (1 / 3) / s, (1 / 3) / s])
    torch.testing.assert_close(adv, expected)
    centered = losses.group_advantages(rewards, group, normalize_std=False)
    torch.testing.assert_close(centered, torch.tensor([2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3]))


def test_group_advantages_constant_group_is_zero_and_groups_need_not_be_contiguous():
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    group = torch.tensor([7, 3, 7, 3])  # each group constant
    assert torch.equal(losses.group_advantages(rewards, group), torch.zeros(4))
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    group = torch.tensor([5, 2, 5, 2])
    adv = losses.group_advantages(rewards, group, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5]) / math.sqrt(0.5))


def test_aggregate_hand_computed():
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert losses.aggregate(per_token, mask, "token").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert losses.aggregate(per_token, mask, "sequence").item() == pytest.approx((2 + 4) / 2)
    empty = torch.zeros(2, 3)
    assert losses.aggregate(per_token, empty, "token").item() == 0.0
    with pytest.raises(ValueError):
        losses.aggregate(per_token, mask, "nope")


def test_aggregate_with_a_minibatch_total_gives_shares_that_add_up():
    """A micro-batch divides by the whole minibatch's count, so its shares add up to the minibatch's mean
    however it is split (the loop's gradient accumulation and data parallelism rest on this)."""
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 7.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])  # the last row has no trained token
    assert losses.aggregate_count(mask, "token") == 4.0
    assert losses.aggregate_count(mask, "sequence") == 2.0
    assert losses.aggregate(per_token[:1], mask[:1], "token", total=4.0).item() == pytest.approx(6 / 4)
    assert losses.aggregate(per_token[1:], mask[1:], "token", total=4.0).item() == pytest.approx(4 / 4)
    assert losses.aggregate(per_token[:1], mask[:1], "sequence", total=2.0).item() == pytest.approx(2 / 2)
    assert losses.aggregate(per_token[1:], mask[1:], "sequence", total=2.0).item() == pytest.approx(4 / 2)
    for mode in ("token", "sequence"):
        whole = losses.aggregate(per_token, mask, mode)
        total = losses.aggregate_count(mask, mode)
        shares = [losses.aggregate(per_token[i:i + 1], mask[i:i + 1], mode, total) for i in range(3)]
        assert sum(shares).item() == pytest.approx(whole.item(), abs=1e-7)
    # a micro-batch of masked rows only: exactly 0, whatever the total
    assert losses.aggregate(per_token[2:], mask[2:], "token", total=4.0).item() == 0.0
    assert losses.aggregate(per_token, torch.zeros(3, 3), "token", total=0.0).item() == 0.0


def test_clipped_policy_gradient_hand_computed():
    old = torch.zeros(1, 4)
    # ratios 1.5, 0.5, 1.1, 0.9 ; advantages +1 for row 0
    new = torch.log(torch.tensor([[1.5, 0.5, 1.1, 0.9]]))
    loss, clipped = losses.clipped_policy_gradient(new, old, torch.tensor([1.0]), 0.2, 0.2)
    # A>0: min(r, clip(r)) -> 1.2, 0.5, 1.1, 0.9
    torch.testing.assert_close(loss, -torch.tensor([[1.2, 0.5, 1.1, 0.9]]))
    assert clipped.tolist() == [[True, False, False, False]]
    loss, clipped = losses.clipped_policy_gradient(new, old, torch.tensor([-2.0]), 0.2, 0.3)
    # A<0: min(-2r, -2 clip(r, 0.8, 1.3)) -> r=1.5: min(-3, -2.6) = -3; r=0.5: min(-1, -1.6) = -1.6
    torch.testing.assert_close(loss, torch.tensor([[3.0, 1.6, 2.2, 1.8]]))
    assert clipped.tolist() == [[False, True, False, False]]


def test_clipped_policy_gradient_gradient_is_zero_where_clipped():
    old = torch.zeros(1, 2)
    new = torch.log(torch.tensor([[1.5, 1.0]])).requires_grad_()
    loss, _ = losses.clipped_policy_gradient(new, old, torch.tensor([1.0]))
    loss.sum().backward()
    assert new.grad[0, 0] == 0  # clipped: no gradient
    assert new.grad[0, 1] == pytest.approx(-1.0)  # d(-r A)/d log r = -r A = -1


def test_kl_sampled_values():
    logp = torch.log(torch.tensor([0.5]))
    ref = torch.log(torch.tensor([0.25]))
    d = math.log(2)
    assert losses.kl_sampled(logp, ref, "k1").item() == pytest.approx(d)
    assert losses.kl_sampled(logp, ref, "k2").item() == pytest.approx(0.5 * d * d)
    assert losses.kl_sampled(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + d)


def _exact_expected_grad(estimator, theta, ref_logp):
    """sum_y p(y) grad k(y): the expected gradient of a sampled estimator, by enumeration."""
    logp = torch.log_softmax(theta, -1)
    per_y = losses.kl_sampled(logp, ref_logp, estimator)  # [V]
    weights = logp.exp().detach()
    (grad,) = torch.autograd.grad((weights * per_y).sum(), theta)
    return grad


@pytest.fixture
def dists():
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(7, generator=g, dtype=torch.float64).requires_grad_()
    ref_logp = torch.log_softmax(torch.randn(7, generator=g, dtype=torch.float64), -1)
    return theta, ref_logp


def test_k2_expected_gradient_is_reverse_kl_gradient(dists):
    theta, ref_logp = dists
    logp = torch.log_softmax(theta, -1)
    reverse_kl = (logp.exp() * (logp - ref_logp)).sum()  # exact, full vocabulary
    (exact,) = torch.autograd.grad(reverse_kl, theta)
    torch.testing.assert_close(_exact_expected_grad("k2", theta, ref_logp), exact, rtol=1e-10, atol=1e-12)


def test_k3_expected_gradient_is_forward_kl_gradient_not_reverse(dists):
    theta, ref_logp = dists
    logp = torch.log_softmax(theta, -1)
    forward_kl = (ref_logp.exp() * (ref_logp - logp)).sum()
    reverse_kl = (logp.exp() * (logp - ref_logp)).sum()
    (g_fwd,) = torch.autograd.grad(forward_kl, theta, retain_graph=True)
    (g_rev,) = torch.autograd.grad(reverse_kl, theta)
    g_k3 = _exact_expected_grad("k3", theta, ref_logp)
    torch.testing.assert_close(g_k3, g_fwd, rtol=1e-10, atol=1e-12)
    assert (g_k3 - g_rev).abs().max() > 1e-3  # the documented pitfall is real


def test_k1_expected_gradient_is_zero(dists):
    theta, ref_logp = dists
    assert _exact_expected_grad("k1", theta, ref_logp).abs().max() < 1e-12


def test_k2_monte_carlo_gradient_matches_exact(dists):
    """The sampled estimator, averaged over real samples, approaches the exact gradient."""
    theta, ref_logp = dists
    logp = torch.log_softmax(theta, -1)
    (exact,) = torch.autograd.grad((logp.exp() * (logp - ref_logp)).sum(), theta)
    y = torch.multinomial(logp.exp().detach(), 200_000, replacement=True, generator=torch.Generator().manual_seed(1))
    logp = torch.log_softmax(theta, -1)
    mc = losses.kl_sampled(logp[y], ref_logp[y], "k2").mean()
    (g,) = torch.autograd.grad(mc, theta)
    # standard error of this estimate is ~1e-3 here; 1e-2 fails if the estimator is biased
    torch.testing.assert_close(g, exact, atol=1e-2, rtol=0)


def test_privileged_margin_hand_computed():
    delta = torch.tensor([0.5, -0.2, 0.05, 0.3])
    adv = torch.tensor([1.0, -1.0, 2.0, 0.0])  # the last trajectory's group had equal rewards
    loss, slack = losses.privileged_margin(delta, adv, margin=0.1)
    # slack = m - A * Delta = 0.1 - 0.5, 0.1 - 0.2, 0.1 - 0.1, 0.1 - 0
    torch.testing.assert_close(slack, torch.tensor([-0.4, -0.1, 0.0, 0.1]))
    assert loss.item() == pytest.approx(0.0)  # every active trajectory meets the margin
    loss, _ = losses.privileged_margin(torch.tensor([0.0, 0.3, -0.1]), torch.tensor([1.0, -0.5, 1.0]), margin=0.2)
    # hinge: max(0, 0.2 - 0) = 0.2, max(0, 0.2 + 0.15) = 0.35, max(0, 0.2 + 0.1) = 0.3 -> mean 0.85 / 3
    assert loss.item() == pytest.approx(0.85 / 3)


def test_privileged_margin_and_privilege_with_a_minibatch_total():
    delta, adv = torch.tensor([0.0, 0.3, -0.1, 0.2]), torch.tensor([1.0, -0.5, 1.0, 0.0])
    active = torch.tensor([True, True, False, True])  # row 2 has no context, row 3 no advantage
    # constrained rows 0 and 1: hinge 0.2 and 0.35; A * Delta 0 and -0.15; the minibatch has 5 such rows
    loss, _ = losses.privileged_margin(delta, adv, 0.2, active, total=5.0)
    assert loss.item() == pytest.approx((0.2 + 0.35) / 5)
    assert losses.privilege(delta, adv, active, total=5.0).item() == pytest.approx(-0.15 / 5)
    assert losses.privilege(delta, adv, active).item() == pytest.approx(-0.15 / 2)


def test_privileged_margin_gradient_pushes_delta_with_the_advantage():
    delta = torch.tensor([0.0, 0.0], requires_grad=True)
    loss, _ = losses.privileged_margin(delta, torch.tensor([1.0, -1.0]), margin=0.1)
    loss.backward()
    # descending the loss raises Delta where A > 0 and lowers it where A < 0
    assert delta.grad.tolist() == pytest.approx([-0.5, 0.5])


def test_sequence_mean():
    x = torch.tensor([[1.0, 3.0, 9.0], [2.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert losses.sequence_mean(x, m).tolist() == [2.0, 2.0]
