"""megarl's GPG, DPPO and verl's other loss modes against verl 0.9.1's own code: the policy losses
`gpg`, `dppo_tv`, `dppo_kl`, `sapo`, `cispo`, `clip_cov`, `kl_cov`, `geo_mean`, `dro`
(`compute_policy_loss_*` of its core_algos.py) on random float32 batches with masks,
rows without a valid token, zero advantages and rollout IS weights, under every loss_agg_mode,
the mini-batch's counts passed as verl's engine passes them: loss, gradient and verl's metrics
within float32 tolerance; GPG's advantage (`compute_gpg_outcome_advantage`); and bypass mode's
loss, which replaces any loss_mode, as verl's; a verl command line per new mode through megarl's
main_ppo reaches the loss verl's own config makes. verl is loaded from its wheel by the `verl`
fixture of test_rollout_correction_verl.py (its functions executed from the zip, unchanged)."""
import copy
import functools
import sys
import types
from pathlib import Path
from unittest import mock

import numpy
import pytest
import torch
import yaml

from megarl.algos.advantages import compute_advantages
from megarl.algos.from_config import actor_loss_kwargs, bypass_kwargs
from megarl.algos.losses import LOSS_AGG_MODES, actor_loss, policy_loss
from megarl.config import load_and_validate
from megarl.config.args import experiment_file
from megarl.trainer.main_ppo import build_parser

sys.path.insert(0, str(Path(__file__).parent))  # verl's wheel as the rollout-correction tests load it
from test_rollout_correction_verl import REQUIRED, RC, ActorConfig, verl  # noqa: E402,F401  (verl: the fixture)

RTOL, ATOL = 1e-5, 1e-6  # float32
CLIPS = {"gpg": (0.2, 0.28, 3.0), "dppo_tv": (0.15, 0.15, 1.5), "dppo_kl": (0.05, 0.05, 1.5)}  # low, high, c


def random_batch(seed: int, rows: int = 12, width: int = 10):
    """(old, new, advantages, mask, weights) float32 [rows, width]: log-probs in [-3, 0) moved by
    ~N(0, 0.5) nats (kept below 0: probabilities), advantages ~N(0, 1) with a fifth exactly 0, rows
    3 and 8 without a valid token, positive IS weights; padding holds values like the rest."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, width + 1, (rows,), generator=g)
    lengths[[3, 8]] = 0
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    old = -3.0 * torch.rand(rows, width, generator=g)
    new = torch.clamp(old + 0.5 * torch.randn(rows, width, generator=g), max=-1e-3)
    advantages = torch.randn(rows, width, generator=g)
    advantages[torch.rand(rows, width, generator=g) < 0.2] = 0.0
    weights = torch.exp(0.3 * torch.randn(rows, width, generator=g))
    return old, new, advantages, mask, weights


def counts(mask: torch.Tensor) -> dict:
    return {"num_tokens": float(mask.sum()), "num_seqs": float(mask.any(-1).sum())}


def verls_policy_loss(verl, loss_mode, old, new, advantages, mask, loss_agg_mode, weights=None):
    low, high, c = CLIPS[loss_mode]
    n = counts(mask)
    actor = ActorConfig(clip_ratio=0.2, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c,
                        global_batch_info={"dp_size": 1, "batch_num_tokens": n["num_tokens"],
                                           "global_batch_size": n["num_seqs"]})
    log_prob = new.clone().requires_grad_(True)
    with mock.patch.dict(sys.modules, verl.modules):
        loss, metrics = verl.losses[f"compute_policy_loss_{loss_mode}"](
            old, log_prob, advantages, mask.float(), loss_agg_mode=loss_agg_mode, config=actor,
            rollout_is_weights=weights)
    loss.backward()
    return loss, log_prob.grad, metrics


@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_mode", ["gpg", "dppo_tv", "dppo_kl"])
def test_the_policy_loss_its_gradient_and_metrics_are_verls(verl, loss_mode, loss_agg_mode, with_weights):
    old, new, advantages, mask, weights = random_batch(1)
    weights = weights if with_weights else None
    low, high, c = CLIPS[loss_mode]
    log_prob = new.clone().requires_grad_(True)
    loss, metrics = policy_loss(old, log_prob, advantages, mask,
                                clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c, loss_mode=loss_mode,
                                loss_agg_mode=loss_agg_mode, rollout_is_weights=weights, **counts(mask))
    loss.backward()
    their_loss, their_grad, their_metrics = verls_policy_loss(verl, loss_mode, old, new, advantages, mask,
                                                              loss_agg_mode, weights)

    assert loss.item() == pytest.approx(their_loss.item(), rel=RTOL, abs=ATOL)
    torch.testing.assert_close(log_prob.grad, their_grad, rtol=RTOL, atol=1e-8)
    assert log_prob.grad.abs().sum() > 0
    assert metrics["pg_loss"].item() == pytest.approx(their_loss.item(), rel=RTOL, abs=ATOL)
    if loss_mode == "gpg":
        assert their_metrics == {}
        assert "pg_clipfrac" not in metrics
        return
    assert metrics["ppo_kl"].item() == pytest.approx(their_metrics["actor/ppo_kl"], rel=RTOL, abs=ATOL)
    assert metrics["pg_clipfrac"].item() == pytest.approx(their_metrics["actor/pg_clipfrac"], abs=ATOL)
    assert metrics["pg_clipfrac_dual"].item() == pytest.approx(their_metrics["actor/pg_clipfrac_lower"], abs=ATOL)
    # the batch reaches every branch: tokens out of the region on both sides, ratios truncated
    assert 0 < metrics["pg_clipfrac_high"].item() and 0 < metrics["pg_clipfrac_low"].item()
    assert metrics["pg_clipfrac"].item() == pytest.approx(
        metrics["pg_clipfrac_high"].item() + metrics["pg_clipfrac_low"].item())
    assert 0 < metrics["pg_clipfrac_dual"].item()


# ------------------------------------------------------------------ the other loss modes of verl 0.9.1
# each mode's options (megarl's policy_loss keywords, verl's config names), chosen so every branch runs:
# shares of 5-10 % (verl's 0.0002 picks one token of these small batches)
MODES = {
    "sapo": {"tau_pos": 1.0, "tau_neg": 1.05},
    "cispo": {},
    "clip_cov": {"clip_cov_ratio": 0.05, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0},
    "kl_cov": {"kl_cov_ratio": 0.1, "ppo_kl_coef": 0.5},
    "geo_mean": {},
    "dro": {"dro_beta": 0.5},
}
MODE_CLIPS = {"geo_mean": (0.4, 0.4)}  # GMPO's range (e^-0.4, e^0.4); the others DAPO's (0.2, 0.28)
# verl's metric -> megarl's (megarl.algos.losses.policy_loss: one meaning per name across modes)
VERL_METRICS = {
    "sapo": {"pg_clipfrac": "pg_clipfrac", "ppo_kl": "ppo_kl", "pg_clipfrac_lower": "pg_clipfrac_dual"},
    "cispo": {"pg_clipfrac": "pg_clipfrac", "ppo_kl": "ppo_kl", "pg_clipfrac_lower": "pg_clipfrac_dual"},
    "clip_cov": {"pg_clipfrac": "pg_clipfrac", "ppo_kl": "ppo_kl"},
    "kl_cov": {"ppo_kl": "ppo_kl_abs"},
    "geo_mean": {"pg_clipfrac": "pg_clipfrac_high", "ppo_kl": "ppo_kl", "pg_clipfrac_lower": "pg_clipfrac_low"},
    "dro": {"ppo_kl": "ppo_kl"},
}


def ours_and_verls(verl, loss_mode, batch, loss_agg_mode, with_weights, seed=0):
    """(our loss, gradient, metrics), (verl's loss, gradient, metrics) of `loss_mode` on `batch`,
    torch's global RNG seeded with `seed` before each (clip_cov draws its tokens from it)."""
    old, new, advantages, mask, weights = batch
    weights = weights if with_weights else None
    low, high = MODE_CLIPS.get(loss_mode, (0.2, 0.28))
    options = MODES[loss_mode]
    log_prob = new.clone().requires_grad_(True)
    torch.manual_seed(seed)
    loss, metrics = policy_loss(old, log_prob, advantages, mask, clip_ratio_low=low, clip_ratio_high=high,
                                loss_mode=loss_mode, loss_agg_mode=loss_agg_mode, rollout_is_weights=weights,
                                **options, **counts(mask))
    loss.backward()
    n = counts(mask)
    actor = ActorConfig(clip_ratio=0.2, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=3.0,
                        tau_pos=options.get("tau_pos"), tau_neg=options.get("tau_neg"),
                        policy_loss=types.SimpleNamespace(**{k: v for k, v in options.items() if "tau" not in k}),
                        global_batch_info={"dp_size": 1, "batch_num_tokens": n["num_tokens"],
                                           "global_batch_size": n["num_seqs"]})
    their_log_prob = new.clone().requires_grad_(True)
    torch.manual_seed(seed)
    with mock.patch.dict(sys.modules, verl.modules):
        their_loss, their_metrics = verl.losses[f"compute_policy_loss_{loss_mode}"](
            old, their_log_prob, advantages, mask.float(), loss_agg_mode=loss_agg_mode, config=actor,
            rollout_is_weights=weights)
    their_loss.backward()
    return (loss, log_prob.grad, metrics), (their_loss, their_log_prob.grad, their_metrics)


@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("loss_agg_mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("loss_mode", list(MODES))
def test_the_other_loss_modes_their_gradients_and_metrics_are_verls(verl, loss_mode, loss_agg_mode, with_weights):
    """sapo, cispo, clip_cov, kl_cov, geo_mean and dro against verl's `compute_policy_loss_<mode>` on
    a batch with rows 3 and 8 empty. geo_mean: verl averages over all 12 rows of the micro-batch
    (`torch.mean`), megarl over the 10 responses with a valid token (the mini-batch's
    `num_seqs`): megarl's loss is verl's x 12 / 10. clip_cov draws its tokens at random from torch's
    global RNG, seeded alike for both."""
    batch = random_batch(1)
    (loss, grad, metrics), (their_loss, their_grad, their_metrics) = ours_and_verls(
        verl, loss_mode, batch, loss_agg_mode, with_weights)
    mask = batch[3]
    scale = mask.shape[0] / mask.any(-1).sum().item() if loss_mode == "geo_mean" else 1.0
    assert scale == (1.2 if loss_mode == "geo_mean" else 1.0)

    assert loss.item() == pytest.approx(their_loss.item() * scale, rel=RTOL, abs=ATOL)
    torch.testing.assert_close(grad, their_grad * scale, rtol=RTOL, atol=1e-8)
    assert grad.abs().sum() > 0
    assert metrics["pg_loss"].item() == pytest.approx(loss.item(), rel=RTOL, abs=ATOL)
    names = VERL_METRICS[loss_mode]
    assert {name.removeprefix("actor/") for name in their_metrics} == names.keys()
    for theirs, ours in names.items():
        assert metrics[ours].item() == pytest.approx(their_metrics[f"actor/{theirs}"], rel=RTOL, abs=ATOL), theirs
    # the batch reaches each mode's branches
    if loss_mode in ("cispo", "geo_mean"):
        assert 0 < metrics["pg_clipfrac_high"].item() and 0 < metrics["pg_clipfrac_low"].item()
    if loss_mode in ("cispo", "clip_cov", "geo_mean"):
        assert metrics["pg_clipfrac"].item() > 0
        assert metrics["pg_clipfrac"].item() == pytest.approx(
            metrics["pg_clipfrac_high"].item() + metrics["pg_clipfrac_low"].item())
    if loss_mode == "kl_cov":
        assert metrics["ppo_kl_abs"].item() > abs(metrics["ppo_kl"].item())


def test_geo_mean_is_verls_where_every_row_holds_a_response(verl):
    """Without rows lacking a valid token megarl's geo_mean is verl's exactly (no rescaling)."""
    old, new, advantages, mask, weights = random_batch(3)
    rows = mask.any(-1)
    batch = tuple(t[rows] for t in (old, new, advantages, mask, weights))
    (loss, grad, _), (their_loss, their_grad, _) = ours_and_verls(verl, "geo_mean", batch, "token-mean", True)
    assert loss.item() == pytest.approx(their_loss.item(), rel=RTOL, abs=ATOL)
    torch.testing.assert_close(grad, their_grad, rtol=RTOL, atol=1e-8)


@pytest.mark.parametrize("loss_mode", ["sapo", "cispo", "geo_mean", "dro"])
def test_micro_batches_add_up_to_verls_loss_of_the_whole_mini_batch(verl, loss_mode):
    """Cut into micro-batches of 4, 3 and 3 responses, each aggregated with the mini-batch's counts
    (as megarl's engine does), the losses and gradients add up to verl's on the whole mini-batch
    (every row a response). (clip_cov and kl_cov pick their tokens per micro-batch, as verl's.)"""
    old, new, advantages, mask, weights = random_batch(5)
    rows = mask.any(-1)
    batch = tuple(t[rows] for t in (old, new, advantages, mask, weights))
    _, (their_loss, their_grad, _) = ours_and_verls(verl, loss_mode, batch, "seq-mean-token-sum", True)
    old, new, advantages, mask, weights = batch
    low, high = MODE_CLIPS.get(loss_mode, (0.2, 0.28))
    log_prob = new.clone().requires_grad_(True)
    total = sum(policy_loss(old[part], log_prob[part], advantages[part], mask[part], clip_ratio_low=low,
                            clip_ratio_high=high, loss_mode=loss_mode, loss_agg_mode="seq-mean-token-sum",
                            rollout_is_weights=weights[part], **MODES[loss_mode], **counts(mask))[0]
                for part in (slice(0, 4), slice(4, 7), slice(7, 10)))
    total.backward()
    assert len(mask) == 10
    assert total.item() == pytest.approx(their_loss.item(), rel=RTOL, abs=ATOL)
    torch.testing.assert_close(log_prob.grad, their_grad, rtol=RTOL, atol=1e-8)


def test_clip_cov_draws_its_tokens_at_random_as_verl(verl):
    """Two seeds draw different tokens (the selection is random, not a fixed rule) and under each
    seed megarl's draw is verl's; with a share covering every eligible token the draw is the
    same under any seed."""
    batch = random_batch(1)
    losses = []
    for seed in (0, 1, 2):
        (loss, _, metrics), (their_loss, _, their_metrics) = ours_and_verls(
            verl, "clip_cov", batch, "token-mean", False, seed=seed)
        assert loss.item() == pytest.approx(their_loss.item(), rel=RTOL, abs=ATOL)
        assert metrics["pg_clipfrac"].item() == pytest.approx(their_metrics["actor/pg_clipfrac"])
        losses.append(loss.item())
    assert len(set(losses)) > 1, "every seed cut the same tokens: the draw was not tested"
    old, new, advantages, mask, _ = batch
    everything = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        everything.append(policy_loss(old, new, advantages, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                                      loss_mode="clip_cov", clip_cov_ratio=1.0, **counts(mask)))
    assert everything[0][0].item() == everything[1][0].item()
    assert everything[0][1]["pg_clipfrac"] > metrics["pg_clipfrac"]


# a verl command line per mode: the mode and its options, some off verl's defaults (the others are verl's)
COMMAND_LINES = {
    "sapo": ["actor_rollout_ref.actor.tau_neg=2.0"],
    "cispo": ["actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28"],
    "clip_cov": ["actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.05",
                 "actor_rollout_ref.actor.policy_loss.clip_cov_lb=0.5"],
    "kl_cov": ["actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.1"],
    "geo_mean": ["actor_rollout_ref.actor.clip_ratio_low=0.4", "actor_rollout_ref.actor.clip_ratio_high=0.4"],
    "dro": ["actor_rollout_ref.actor.policy_loss.dro_beta=0.3"],
}


@pytest.mark.parametrize("loss_mode", list(COMMAND_LINES))
def test_a_verl_command_line_reaches_the_loss_as_verl_reads_it(verl, loss_mode):
    """`python -m megarl.trainer.main_ppo --config-name=ppo_megatron_trainer ... policy_loss.loss_mode=<mode>`
    (the entry point of verl's main_ppo) loads, and the actor's loss from that config (as the
    Megatron engine makes it: actor_loss_kwargs) is verl's `compute_policy_loss_<mode>` with verl's
    own config: its dumped ppo_megatron_trainer.yaml with the same overrides, every key the line
    leaves out at verl's default."""
    overrides = [f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}", *COMMAND_LINES[loss_mode]]
    args = build_parser().parse_intermixed_args(["--config-name=ppo_megatron_trainer", *REQUIRED, *overrides])
    config = load_and_validate(experiment_file(args), args.overrides)
    section = copy.deepcopy(verl.dumped["actor_rollout_ref"]["actor"])
    for override in overrides:
        key, _, value = override.partition("=")
        *groups, name = key.split(".")[2:]
        functools.reduce(lambda tree, group: tree[group], groups, section)[name] = yaml.safe_load(value)
    old, new, advantages, mask, weights = random_batch(4)
    n = counts(mask)
    actor = ActorConfig(**{key: section[key] for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high",
                                                         "clip_ratio_c", "tau_pos", "tau_neg")},
                        policy_loss=types.SimpleNamespace(**section["policy_loss"]),
                        global_batch_info={"dp_size": 1, "batch_num_tokens": n["num_tokens"],
                                           "global_batch_size": n["num_seqs"]})
    rows = mask.any(-1)  # geo_mean: verl's mean over every row is megarl's over the responses where all have one
    old, new, advantages, mask, weights = (t[rows] for t in (old, new, advantages, mask, weights))
    log_prob = new.clone().requires_grad_(True)
    torch.manual_seed(0)
    loss, _ = actor_loss(log_prob, old, advantages, mask, rollout_is_weights=weights,
                         **actor_loss_kwargs(config.actor_rollout_ref.actor), **n)
    loss.backward()
    their_log_prob = new.clone().requires_grad_(True)
    torch.manual_seed(0)
    with mock.patch.dict(sys.modules, verl.modules):
        their_loss, _ = verl.losses[f"compute_policy_loss_{loss_mode}"](
            old, their_log_prob, advantages, mask.float(), loss_agg_mode=section["loss_agg_mode"], config=actor,
            rollout_is_weights=weights)
    their_loss.backward()
    assert config.actor_rollout_ref.actor.policy_loss.loss_mode == loss_mode
    assert loss.item() == pytest.approx(their_loss.item(), rel=RTOL, abs=ATOL)
    torch.testing.assert_close(log_prob.grad, their_log_prob.grad, rtol=RTOL, atol=1e-8)


def test_megarls_defaults_of_the_loss_options_are_verls(verl):
    actor = verl.dumped["actor_rollout_ref"]["actor"]
    ours = load_and_validate(None, REQUIRED).actor_rollout_ref.actor
    assert {key: getattr(ours.policy_loss, key) for key in actor["policy_loss"] if not key.startswith("_")} == \
        {**{key: value for key, value in actor["policy_loss"].items() if not key.startswith("_")}}
    assert (ours.tau_pos, ours.tau_neg) == (actor["tau_pos"], actor["tau_neg"])


@pytest.mark.parametrize("loss_mode", ["gspo", "gpg", "dppo_tv"])
def test_bypass_mode_replaces_the_loss_mode_as_verls(verl, loss_mode):
    """With algorithm.rollout_correction.bypass_mode (loss_type=ppo_clip) the actor's loss is verl's
    `compute_policy_loss_bypass_mode`, PPO against the rollout's log-probs, whatever loss_mode says
    (verl's `apply_bypass_mode` sets loss_mode="bypass_mode")."""
    rollout, new, advantages, mask, _ = (t.double() for t in random_batch(2))
    mask = mask.long()
    cfg = load_and_validate(None, REQUIRED + [f"{RC}.bypass_mode=true"]).algorithm.rollout_correction
    log_prob = new.clone().requires_grad_(True)
    loss, _ = actor_loss(log_prob, rollout, advantages, mask, clip_ratio_low=0.2, clip_ratio_high=0.28,
                         loss_mode=loss_mode, bypass=bypass_kwargs(cfg), **counts(mask))
    loss.backward()
    their_log_prob = new.clone().requires_grad_(True)
    n = counts(mask)
    actor = ActorConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                        policy_loss={"rollout_correction": verl.config(bypass_mode=True, loss_type="ppo_clip")},
                        global_batch_info={"dp_size": 1, "batch_num_tokens": n["num_tokens"],
                                           "global_batch_size": n["num_seqs"]})
    with mock.patch.dict(sys.modules, verl.modules):
        their_loss, _ = verl.losses["compute_policy_loss_bypass_mode"](
            rollout, their_log_prob, advantages, mask.double(), loss_agg_mode="token-mean", config=actor)
    their_loss.backward()
    assert loss.item() == pytest.approx(their_loss.item(), rel=1e-9)
    torch.testing.assert_close(log_prob.grad, their_log_prob.grad, rtol=1e-9, atol=1e-12)


def groups(seed: int, num_groups: int = 6, discrete: bool = True):
    """(rewards, mask, uids): groups of 2-5 responses in shuffled order, an outcome score on each
    response's last valid token (0/1/2 or continuous; one group all equal), float32."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(2, 6, (num_groups,), generator=g).tolist()
    uids = [f"p{k}" for k, size in enumerate(sizes) for _ in range(size)]
    order = torch.randperm(len(uids), generator=g).tolist()
    uids = [uids[i] for i in order]
    scores = (torch.randint(0, 3, (len(uids),), generator=g).float() if discrete
              else torch.randn(len(uids), generator=g))
    scores[[i for i, uid in enumerate(uids) if uid == "p0"]] = 1.0
    width = 7
    lengths = torch.randint(1, width + 1, (len(uids),), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    rewards = torch.zeros(len(uids), width)
    rewards[torch.arange(len(uids)), lengths - 1] = scores
    return rewards, mask, uids


@pytest.mark.parametrize("discrete", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gpg_advantages_are_verls(verl, seed, discrete):
    rewards, mask, uids = groups(seed, discrete=discrete)
    ours = compute_advantages("gpg", rewards, mask, uids=uids)
    theirs, their_returns = verl.losses["compute_gpg_outcome_advantage"](rewards, mask, numpy.array(uids))
    torch.testing.assert_close(ours.advantages, theirs, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(ours.returns, their_returns, rtol=RTOL, atol=ATOL)
    assert ours.advantages.abs().max() > 1.0  # alpha scales the centred scores
    assert ours.metrics["num_uniform_groups"] >= 1


def test_a_group_of_one_gets_0_where_verl_gives_alpha_times_its_score(verl):
    """megarl's rule for every group estimator (the `megarl.algos` docstring): a lone response
    has no baseline and gets advantage 0; verl's code takes mean 0 there."""
    rewards, mask, uids = groups(3)
    rewards = torch.cat([rewards, torch.tensor([[0.0, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0]])])
    mask, uids = torch.cat([mask, torch.tensor([[1, 1, 0, 0, 0, 0, 0]])]), uids + ["lone"]
    ours = compute_advantages("gpg", rewards, mask, uids=uids)
    theirs, _ = verl.losses["compute_gpg_outcome_advantage"](rewards, mask, numpy.array(uids))
    alpha = len(uids) / int(rewards.sum(-1).count_nonzero())
    assert theirs[-1, :2].tolist() == pytest.approx([2.0 * alpha] * 2)
    assert ours.advantages[-1].eq(0).all()
    torch.testing.assert_close(ours.advantages[:-1], theirs[:-1], rtol=RTOL, atol=ATOL)
