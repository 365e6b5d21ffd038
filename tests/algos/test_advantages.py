"""Advantage estimators: hand-computed values, properties, and cross-checks against plain loops."""
import math
import random
import statistics

import pytest
import torch

from megarl.algos.advantages import ADV_ESTIMATOR_REGISTRY, compute_advantages
from megarl.config.schema import ADV_ESTIMATORS


def outcome_rewards(scores, lengths, width):
    """Score on the last valid token; mask 1 on the first `length` tokens."""
    rewards = torch.zeros(len(scores), width, dtype=torch.float64)
    mask = torch.zeros(len(scores), width, dtype=torch.long)
    for i, (s, n) in enumerate(zip(scores, lengths)):
        mask[i, :n] = 1
        rewards[i, n - 1] = s
    return rewards, mask


def test_registry_names_are_the_config_names():
    assert tuple(ADV_ESTIMATOR_REGISTRY) == ADV_ESTIMATORS


# -------------------------------------------------------------------------- hand-computed values
# Groups are interleaved on purpose: grouping is by uid, never by position.
UIDS = ["a", "b", "a", "c", "a", "b"]
SCORES = [1.0, 0.5, 0.0, 2.0, 0.0, 0.5]
LENGTHS = [3, 1, 2, 4, 4, 2]


def test_grpo_by_hand():
    rewards, mask = outcome_rewards(SCORES, LENGTHS, 4)
    result = compute_advantages("grpo", rewards, mask, uids=UIDS)
    # group a = [1, 0, 0]: mean 1/3, unbiased std sqrt(1/3); b = [0.5, 0.5] uniform; c = [2] singleton
    std = math.sqrt(1 / 3)
    expected = [(2 / 3) / std, 0.0, (-1 / 3) / std, 0.0, (-1 / 3) / std, 0.0]
    for i, (value, n) in enumerate(zip(expected, LENGTHS)):
        assert result.advantages[i, :n].tolist() == pytest.approx([value] * n, abs=1e-5)
        assert result.advantages[i, n:].eq(0).all()
    assert torch.equal(result.returns, result.advantages)
    assert result.metrics == {"num_groups": 3.0, "num_singleton_groups": 1.0, "num_uniform_groups": 1.0}


def test_dr_grpo_by_hand():
    rewards, mask = outcome_rewards(SCORES, LENGTHS, 4)
    result = compute_advantages("grpo", rewards, mask, uids=UIDS, norm_adv_by_std_in_grpo=False)
    assert result.advantages[:, 0].tolist() == pytest.approx([2 / 3, 0, -1 / 3, 0, -1 / 3, 0], abs=1e-12)


def test_gpg_by_hand():
    rewards, mask = outcome_rewards(SCORES, LENGTHS, 4)
    result = compute_advantages("gpg", rewards, mask, uids=UIDS)
    # alpha = 6 responses / 4 with a nonzero score = 1.5; group a = [1, 0, 0], mean 1/3: 1.5 x (2/3, -1/3,
    # -1/3); b uniform and c singleton: 0
    assert result.advantages[:, 0].tolist() == pytest.approx([1.0, 0, -0.5, 0, -0.5, 0], abs=1e-12)
    assert result.advantages[3, :4].tolist() == [0.0] * 4 and result.advantages[0, 3] == 0
    assert torch.equal(result.returns, result.advantages)
    assert result.metrics == {"num_groups": 3.0, "num_singleton_groups": 1.0, "num_uniform_groups": 1.0}


def test_rloo_by_hand():
    rewards, mask = outcome_rewards([1.0, 3.0, 0.0, 0.0, 1.0, 7.0], [1, 2, 1, 1, 2, 1], 2)
    result = compute_advantages("rloo", rewards, mask, uids=["a", "b", "a", "a", "b", "c"])
    # a = [1, 0, 0]: 1 - 0, 0 - 1/2, 0 - 1/2; b = [3, 1]: 3 - 1, 1 - 3; c singleton: 0
    assert result.advantages[:, 0].tolist() == pytest.approx([1.0, 2.0, -0.5, -0.5, -2.0, 0.0])
    assert result.advantages[1, 1] == pytest.approx(2.0) and result.advantages[0, 1] == 0


def test_remax_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    result = compute_advantages("remax", rewards, mask, reward_baselines=torch.tensor([0.5, 1.0]))
    assert result.returns.tolist() == [[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]]
    assert result.advantages.tolist() == [[0.5, 0.5, 0.5], [1.0, 1.0, 0.0]]


def whiten(values):
    mean, std = statistics.mean(values), statistics.stdev(values)
    return [(v - mean) / math.sqrt(std**2 + 1e-8) for v in values]


def test_gae_by_hand():
    nan = float("nan")  # padding may hold anything
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, nan], [0.0, nan, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, nan], [0.5, nan, 0.7]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1]])  # row 3: a masked hole (e.g. a tool turn)
    result = compute_advantages("gae", rewards, mask, values=values, gamma=0.9, lam=0.8)
    # row 1: A2 = 1 - .7 = .3; A1 = (.9*.7 - .6) + .72*.3 = .246; A0 = (.9*.6 - .5) + .72*.246 = .21712
    # row 2: A1 = 1 - .4 = .6; A0 = (.9*.4 - .2) + .72*.6 = .592
    # row 3: A2 = .3; the hole is skipped: A0 = (.9*.7 - .5) + .72*.3 = .346
    raw = [0.21712, 0.246, 0.3, 0.592, 0.6, 0.346, 0.3]
    assert result.returns[0].tolist() == pytest.approx([0.71712, 0.846, 1.0])
    assert result.returns[1].tolist() == pytest.approx([0.792, 1.0, 0.0])
    assert result.returns[2].tolist() == pytest.approx([0.846, 0.0, 1.0])
    got = result.advantages[mask.bool()].tolist()
    assert got == pytest.approx(whiten(raw))
    assert result.advantages[1, 2] == 0 and result.advantages[2, 1] == 0


def test_reinforce_plus_plus_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    result = compute_advantages("reinforce_plus_plus", rewards, mask, gamma=0.5)
    assert result.returns.tolist() == [[0.25, 0.5, 1.0], [1.0, 2.0, 0.0]]
    assert result.advantages[mask.bool()].tolist() == pytest.approx(whiten([0.25, 0.5, 1.0, 1.0, 2.0]))
    assert result.advantages[1, 2] == 0


def test_reinforce_plus_plus_baseline_by_hand():
    rewards, mask = outcome_rewards([1.0, 0.0, 5.0], [2, 1, 2], 2)
    result = compute_advantages("reinforce_plus_plus_baseline", rewards, mask, uids=["a", "a", "b"])
    # tokens before whitening: a -> [.5, .5], [-.5]; b singleton -> [0, 0]; mean .1, unbiased var .175
    std = math.sqrt(0.175 + 1e-8)
    assert result.advantages.flatten().tolist() == pytest.approx([0.4 / std, 0.4 / std, -0.6 / std, 0, 0, 0])
    assert result.metrics["num_singleton_groups"] == 1.0


def test_reinforce_plus_plus_carries_the_return_across_a_masked_tool_reply():
    """The issue's minimal case: the masked position holds 0 and does not break the chain."""
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 1]])
    result = compute_advantages("reinforce_plus_plus", rewards, mask, gamma=1.0)
    assert result.returns.tolist() == [[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0]]
    assert result.advantages[mask.bool()].tolist() == pytest.approx(whiten([1, 1, 1, 0, 0, 0, 0]))
    assert result.advantages[0, 2] == 0


def two_turn_batch():
    """Three episodes of width 6: turn 1 on tokens 0-1, a tool's reply on 2-3 (mask 0), turn 2 on
    4-5. Row 0 succeeds in turn 2 with token-level scores 0.2 (end of turn 1) + 0.3 (end of turn 2);
    row 1 fails after two turns; row 2 fails in one turn. NaN on masked positions: never read."""
    nan = float("nan")
    rewards = torch.tensor([[0.0, 0.2, nan, nan, 0.0, 0.3],
                            [0.0, 0.0, nan, nan, 0.0, 0.0],
                            [0.0, 0.0, nan, nan, nan, nan]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0]])
    return rewards, mask, ["p", "p", "p"]


def per_token(rows, mask):
    """Per-row values on every valid token (row-major), as a flat list."""
    return [value for value, m in zip(rows, mask.tolist()) for valid in m if valid]


def test_multi_turn_gaps_by_hand_for_every_estimator():
    rewards, mask, uids = two_turn_batch()
    valid = mask.bool()
    # REINFORCE++ (gamma .5), row 0: t5 = .3, t4 = .15, t1 = .2 + .5 * .15 = .275, t0 = .1375
    result = compute_advantages("reinforce_plus_plus", rewards, mask, gamma=0.5)
    assert result.returns[0].tolist() == pytest.approx([0.1375, 0.275, 0, 0, 0.15, 0.3])
    assert result.returns[1:].abs().sum() == 0
    assert result.advantages[valid].tolist() == pytest.approx(whiten([0.1375, 0.275, 0.15, 0.3] + [0.0] * 6))
    assert result.advantages[0, 0] > 0 and result.advantages[1, 0] < 0  # turn 1 of the success vs a failure

    # GAE (gamma .5, lam .5), values 0 except row 0 [.1, .2, 9, 9, .3, .4] (9 on the gap: skipped):
    # t5: d = .3 - .4 = -.1, A = -.1; t4: d = .5*.4 - .3 = -.1, A = -.1 + .25*-.1 = -.125;
    # t1 (next valid t4): d = .2 + .5*.3 - .2 = .15, A = .15 + .25*-.125 = .11875; t0: d = .5*.2 - .1 = 0,
    # A = .25*.11875 = .0296875; returns = A + V
    values = torch.zeros_like(rewards)
    values[0] = torch.tensor([0.1, 0.2, 9.0, 9.0, 0.3, 0.4], dtype=torch.float64)
    result = compute_advantages("gae", rewards, mask, values=values, gamma=0.5, lam=0.5)
    assert result.returns[0].tolist() == pytest.approx([0.1296875, 0.31875, 0, 0, 0.175, 0.3])
    assert result.advantages[valid].tolist() == pytest.approx(whiten([0.0296875, 0.11875, -0.125, -0.1] + [0.0] * 6))

    # scores .5, 0, 0: group mean 1/6, deviations 1/3, -1/6, -1/6, unbiased var 1/12
    std = math.sqrt(1 / 12)
    result = compute_advantages("grpo", rewards, mask, uids=uids)
    expected = per_token([(1 / 3) / (std + 1e-6), (-1 / 6) / (std + 1e-6), (-1 / 6) / (std + 1e-6)], mask)
    assert result.advantages[valid].tolist() == pytest.approx(expected)
    result = compute_advantages("rloo", rewards, mask, uids=uids)  # s_i - mean of the other two
    assert result.advantages[valid].tolist() == pytest.approx(per_token([0.5, -0.25, -0.25], mask))
    result = compute_advantages("reinforce_plus_plus_baseline", rewards, mask, uids=uids)
    assert result.advantages[valid].tolist() == pytest.approx(whiten(per_token([1 / 3, -1 / 6, -1 / 6], mask)))
    # ReMax (gamma 1): row 0 returns .5 on turn 1, .3 on turn 2; baseline .25
    result = compute_advantages("remax", rewards, mask, reward_baselines=torch.full((3,), 0.25, dtype=torch.float64))
    assert result.returns[0].tolist() == pytest.approx([0.5, 0.5, 0, 0, 0.3, 0.3])
    assert result.advantages[0].tolist() == pytest.approx([0.25, 0.25, 0, 0, 0.05, 0.05])
    for name in ADV_ESTIMATOR_REGISTRY:  # the tool's reply never gets an advantage
        kwargs = dict(uids=uids, values=values, reward_baselines=torch.zeros(3, dtype=torch.float64))
        assert compute_advantages(name, rewards, mask, **kwargs).advantages[~valid].abs().sum() == 0, name


# -------------------------------------------------------------------------- properties
def random_groups(seed, num_groups=7, max_size=6, width=9, discrete=True):
    gen = random.Random(seed)
    uids, scores, lengths = [], [], []
    for g in range(num_groups):
        for _ in range(gen.randint(1, max_size)):
            uids.append(f"prompt-{g}")
            scores.append(float(gen.randint(0, 2)) if discrete else gen.gauss(0, 3))
            lengths.append(gen.randint(1, width))
    order = list(range(len(uids)))
    gen.shuffle(order)
    return [uids[i] for i in order], [scores[i] for i in order], [lengths[i] for i in order], width


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("estimator, norm", [("grpo", True), ("grpo", False), ("rloo", True)])
def test_group_advantages_have_zero_mean_per_group(seed, estimator, norm):
    uids, scores, lengths, width = random_groups(seed)
    rewards, mask = outcome_rewards(scores, lengths, width)
    adv = compute_advantages(estimator, rewards, mask, uids=uids, norm_adv_by_std_in_grpo=norm).advantages
    assert torch.isfinite(adv).all()
    for uid in set(uids):
        members = [i for i, u in enumerate(uids) if u == uid]
        assert sum(adv[i, 0].item() for i in members) == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline", "gpg"])
def test_degenerate_groups_give_zero_not_nan(estimator):
    rewards, mask = outcome_rewards([0.1, 0.1, 0.1, 1.0, 0.3], [2, 2, 2, 2, 2], 2)
    result = compute_advantages(estimator, rewards, mask, uids=["u", "u", "u", "single", "v"])
    assert torch.isfinite(result.advantages).all()
    assert result.advantages.eq(0).all()  # 0.1 * 3 / 3 is not exactly 0.1: equality must be tested exactly
    assert result.metrics == {"num_groups": 3.0, "num_singleton_groups": 2.0, "num_uniform_groups": 1.0}


@pytest.mark.parametrize("estimator", list(ADV_ESTIMATORS))
def test_padding_is_excluded_exactly(estimator):
    uids, scores, lengths, width = random_groups(11, discrete=False)
    rewards, mask = outcome_rewards(scores, lengths, width)
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(rewards.shape, generator=gen, dtype=torch.float64)
    baselines = torch.randn(len(uids), generator=gen, dtype=torch.float64)
    kwargs = dict(uids=uids, values=values, reward_baselines=baselines, gamma=0.95, lam=0.9)
    clean = compute_advantages(estimator, rewards, mask, **kwargs)
    padding = ~mask.bool()
    dirty_rewards = rewards.masked_fill(padding, float("nan"))
    dirty_values = values.masked_fill(padding, 1e30)
    dirty = compute_advantages(estimator, dirty_rewards, mask, **{**kwargs, "values": dirty_values})
    assert torch.equal(clean.advantages, dirty.advantages)
    assert torch.equal(clean.returns, dirty.returns)
    assert clean.advantages[padding].eq(0).all() and clean.returns[padding].eq(0).all()


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus_baseline", "gpg"])
def test_permuting_the_batch_permutes_the_advantages(estimator):
    uids, scores, lengths, width = random_groups(3, discrete=False)
    rewards, mask = outcome_rewards(scores, lengths, width)
    base = compute_advantages(estimator, rewards, mask, uids=uids).advantages
    perm = torch.randperm(len(uids), generator=torch.Generator().manual_seed(1))
    permuted = compute_advantages(estimator, rewards[perm], mask[perm], uids=[uids[i] for i in perm]).advantages
    assert torch.allclose(permuted, base[perm], atol=1e-12)


# -------------------------------------------------------------------------- cross-checks (loops, float64)
def loop_grpo(scores, uids, norm, eps=1e-6):
    out = []
    for i, uid in enumerate(uids):
        group = [scores[j] for j, u in enumerate(uids) if u == uid]
        if len(group) < 2 or max(group) == min(group):
            out.append(0.0)
            continue
        mean = sum(group) / len(group)
        std = math.sqrt(sum((s - mean) ** 2 for s in group) / (len(group) - 1))
        out.append((scores[i] - mean) / (std + eps) if norm else scores[i] - mean)
    return out


def loop_rloo(scores, uids):
    out = []
    for i, uid in enumerate(uids):
        others = [scores[j] for j, u in enumerate(uids) if u == uid and j != i]
        group = others + [scores[i]]
        out.append(0.0 if not others or max(group) == min(group) else scores[i] - sum(others) / len(others))
    return out


def loop_gae(rewards, values, mask, gamma, lam):
    """Explicit per-row GAE over the valid positions only, then whitening."""
    raw = []
    for r, v, m in zip(rewards, values, mask):
        idx = [t for t in range(len(m)) if m[t]]
        adv = {}
        running = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            v_next = v[idx[k + 1]] if k + 1 < len(idx) else 0.0
            running = r[t] + gamma * v_next - v[t] + gamma * lam * running
            adv[t] = running
        raw.append(adv)
    flat = [a for row in raw for a in row.values()]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((a - mean) ** 2 for a in flat) / (len(flat) - 1) + 1e-8)
    returns = [[(row[t] + v[t]) if t in row else 0.0 for t in range(len(v))] for row, v in zip(raw, values)]
    advantages = [[(row[t] - mean) / std if t in row else 0.0 for t in range(len(v))] for row, v in zip(raw, values)]
    return advantages, returns


@pytest.mark.parametrize("seed", range(4))
def test_grpo_and_rloo_match_loops(seed):
    uids, scores, lengths, width = random_groups(100 + seed, num_groups=9, discrete=seed % 2 == 0)
    rewards, mask = outcome_rewards(scores, lengths, width)
    for norm in (True, False):
        got = compute_advantages("grpo", rewards, mask, uids=uids, norm_adv_by_std_in_grpo=norm).advantages
        assert got[:, 0].tolist() == pytest.approx(loop_grpo(scores, uids, norm), rel=1e-12, abs=1e-12)
    got = compute_advantages("rloo", rewards, mask, uids=uids).advantages
    assert got[:, 0].tolist() == pytest.approx(loop_rloo(scores, uids), rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_gae_matches_loop(seed):
    gen = torch.Generator().manual_seed(seed)
    rewards = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    values = torch.randn(5, 8, generator=gen, dtype=torch.float64)
    mask = (torch.rand(5, 8, generator=gen) < 0.7).long()
    mask[:, 0] = 1
    got = compute_advantages("gae", rewards, mask, values=values, gamma=0.97, lam=0.93)
    advantages, returns = loop_gae(rewards.tolist(), values.tolist(), mask.tolist(), 0.97, 0.93)
    assert torch.allclose(got.advantages, torch.tensor(advantages, dtype=torch.float64), atol=1e-10)
    assert torch.allclose(got.returns, torch.tensor(returns, dtype=torch.float64), atol=1e-12)


def test_float32_inputs_give_float32_outputs():
    rewards, mask = outcome_rewards([1.0, 0.0], [2, 2], 2)
    result = compute_advantages("grpo", rewards.float(), mask, uids=["x", "x"])
    assert result.advantages.dtype == torch.float32


# -------------------------------------------------------------------------- dispatcher errors
def test_missing_inputs_and_unknown_names_are_clear():
    rewards, mask = outcome_rewards([1.0], [1], 1)
    with pytest.raises(ValueError, match="adv_estimator='gae' needs `values`"):
        compute_advantages("gae", rewards, mask)
    with pytest.raises(ValueError, match="needs `uids`"):
        compute_advantages("grpo", rewards, mask)
    with pytest.raises(ValueError, match="needs `reward_baselines`"):
        compute_advantages("remax", rewards, mask)
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'.*'gae'"):
        compute_advantages("ppo", rewards, mask)
    with pytest.raises(ValueError, match="uids has 2 entries but the batch has 1"):
        compute_advantages("grpo", rewards, mask, uids=["a", "b"])
    with pytest.raises(ValueError, match=r"must both be \[batch, response_len\]"):
        compute_advantages("grpo", rewards[0], mask[0], uids=["a"])
