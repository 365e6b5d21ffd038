"""Why the actor's update may leave out the rows whose advantages are all 0
(megarl.config.rules.skip_rows): such a row's loss and gradient are exactly 0 in every policy loss
mode, with truncated IS, rollout IS weights and bypass mode, given the whole batch's counts, so the
other rows alone give the loss of all rows; the terms the rules name as inexact do read it."""
import pytest
import torch

from megarl.algos.advantages import zero_advantage_rows
from megarl.algos.from_config import rollout_correction_kwargs
from megarl.algos.losses import LOSS_AGG_MODES, POLICY_LOSS_MODES, actor_loss
from megarl.config import load_config
from megarl.config.rules.skip_rows import ZERO_AT_ZERO_ADVANTAGE

ROWS, LENGTH = 4, 5
ZERO_ROW = 2  # advantage 0 at every response token (its padding holds 0 too)


def _inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 0, 0, 0, 0]], dtype=torch.float32)
    advantages = torch.tensor([1.0, -0.7, 0.0, -1.3])[:, None] * mask
    old = -1.0 - torch.rand(ROWS, LENGTH, generator=g)
    return {"log_prob": (old + 0.4 * torch.randn(ROWS, LENGTH, generator=g)).clamp(max=-0.05),
            "old_log_prob": old, "advantages": advantages, "response_mask": mask,
            "rollout_log_prob": old + 0.3 * torch.randn(ROWS, LENGTH, generator=g),
            "rollout_is_weights": torch.rand(ROWS, LENGTH, generator=g) * 2,
            "ref_log_prob": old + 0.2 * torch.randn(ROWS, LENGTH, generator=g),
            "entropy": torch.rand(ROWS, LENGTH, generator=g) * 3}


def _bypass(loss_type: str, batch_normalize: bool = False) -> dict:
    rc = load_config(None, ["algorithm.rollout_correction.rollout_is=token",
                            f"algorithm.rollout_correction.rollout_is_batch_normalize={str(batch_normalize).lower()}",
                            "algorithm.rollout_correction.rollout_rs=token_k1",
                            "algorithm.rollout_correction.rollout_rs_threshold=0.8_1.25"]).algorithm.rollout_correction
    return {"loss_type": loss_type, "correction": rollout_correction_kwargs(rc)}


# every policy term the update runs with skipping on: each mode, plus TIS, rollout IS weights and bypass mode
SETTINGS = {**{mode: {"loss_mode": mode} for mode in ZERO_AT_ZERO_ADVANTAGE},
            "tis": {"tis_imp_ratio_cap": 1.5}, "rollout_is_weights": {"rollout_is_weights": True},
            "bypass_ppo_clip": {"bypass": _bypass("ppo_clip")}, "bypass_reinforce": {"bypass": _bypass("reinforce")},
            "bypass_ppo_clip_batch_normalized": {"bypass": _bypass("ppo_clip", batch_normalize=True)}}


def _loss(inputs: dict, rows: list[int], agg: str, setting: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, d loss / d log_prob [len(rows), R]) of `rows` alone, with the counts of all rows."""
    mask = inputs["response_mask"]
    log_prob = inputs["log_prob"][rows].clone().requires_grad_(True)
    kwargs = {k: v for k, v in setting.items() if k != "rollout_is_weights"}
    if setting.get("rollout_is_weights"):
        kwargs["rollout_is_weights"] = inputs["rollout_is_weights"][rows]
    keys = ("old_log_prob", "advantages", "response_mask", "rollout_log_prob", "ref_log_prob", "entropy")
    picked = {k: inputs[k][rows] for k in keys}
    loss, _ = actor_loss(log_prob, picked.pop("old_log_prob"), picked.pop("advantages"), picked.pop("response_mask"),
                         loss_agg_mode=agg, clip_ratio_c=3.0, num_tokens=float(mask.sum()),
                         num_seqs=float(ROWS), norm_length=LENGTH, **picked, **kwargs)
    loss.backward()
    return loss.detach(), log_prob.grad


def test_the_modes_the_rules_skip_are_the_loss_modes_but_those_with_terms_of_their_own():
    assert set(POLICY_LOSS_MODES) - set(ZERO_AT_ZERO_ADVANTAGE) == {"dro", "kl_cov", "clip_cov"}


def test_zero_advantage_rows_by_hand():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]])
    advantages = torch.tensor([[0.0, 0.0, 5.0], [1e-30, 0.0, 0.0], [3.0, 3.0, 3.0], [0.0, float("nan"), 0.0]])
    # padding is not read; a tiny advantage is not 0; a row without a response token adds nothing; NaN is not 0
    assert zero_advantage_rows(advantages, mask).tolist() == [True, False, True, False]


@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
@pytest.mark.parametrize("setting", SETTINGS.values(), ids=SETTINGS.keys())
def test_a_zero_advantage_row_adds_nothing_to_the_loss_or_its_gradient(agg, setting):
    inputs = _inputs()
    assert zero_advantage_rows(inputs["advantages"], inputs["response_mask"]).tolist() == [False, False, True, False]
    loss, grad = _loss(inputs, [ZERO_ROW], agg, setting)
    assert loss.item() == 0.0 and torch.count_nonzero(grad) == 0  # exactly, not to rounding
    others = [r for r in range(ROWS) if r != ZERO_ROW]
    full_loss, full_grad = _loss(inputs, list(range(ROWS)), agg, setting)
    kept_loss, kept_grad = _loss(inputs, others, agg, setting)
    assert full_loss != 0
    torch.testing.assert_close(kept_loss, full_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(kept_grad, full_grad[others], rtol=1e-6, atol=0)
    assert torch.count_nonzero(full_grad[ZERO_ROW]) == 0


@pytest.mark.parametrize("term", [{"use_kl_loss": True}, {"entropy_coeff": 0.01},
                                  {"bypass": _bypass("reinforce", batch_normalize=True)},
                                  {"loss_mode": "dro", "mode_options": {"dro_beta": 0.5}},
                                  {"loss_mode": "kl_cov", "mode_options": {"kl_cov_ratio": 0.5}}],
                         ids=["kl_loss", "entropy_bonus", "bypass_reinforce_batch_normalized", "dro", "kl_cov"])
def test_the_terms_the_rules_refuse_do_read_the_zero_advantage_row(term):
    inputs = _inputs()
    others = [r for r in range(ROWS) if r != ZERO_ROW]
    full_loss, full_grad = _loss(inputs, list(range(ROWS)), "token-mean", term)
    kept_loss, kept_grad = _loss(inputs, others, "token-mean", term)
    # leaving the row out changes the loss or the other rows' gradient
    same_loss = torch.allclose(kept_loss, full_loss, rtol=1e-4)
    assert not (same_loss and torch.allclose(kept_grad, full_grad[others], rtol=1e-4))
