"""On-policy distillation's advantage (megarl.algos.opd) on a batch worked by hand.

Two responses, log-probs in nats (student S, teacher T), `kl_coef` 0.5; row 1's third column is
padding (its garbage values must not leak); row 2 is a multi-turn row whose middle token is a
tool's reply (mask 0: no signal, though it is a real token).

    row 0  S [-0.5, -1.0, -2.0]  T [-1.5, -0.5, -2.0]  d = S - T = [ 1.0, -0.5,  0.0]  A [ 0.7,  0.7, 0.7]
    row 1  S [-0.2, -3.0,  pad]  T [-1.2, -1.0,  pad]  d         = [ 1.0, -2.0,  -  ]  A [-0.7, -0.7,  - ]
    row 2  S [-1.0, -4.0, -0.1]  T [-1.0, -0.1, -0.6]  d         = [ 0.0,  tool, 0.5]  A [ 0.0,  -,   0.0]

OPD + RL: A - 0.5 d;  pure OPD: -0.5 d;  reverse_kl_mean = (1 - 0.5 + 0 + 1 - 2 + 0 + 0.5) / 7 = 0,
teacher_log_prob_mean = (-1.5 - 0.5 - 2 - 1.2 - 1 - 1 - 0.6) / 7 = -7.8 / 7.
"""
import math

import pytest
import torch

from megarl.algos.opd import opd_advantages, opd_metrics, reverse_kl

PAD = 123.0  # garbage in padded and masked places
S = torch.tensor([[-0.5, -1.0, -2.0], [-0.2, -3.0, PAD], [-1.0, -4.0, -0.1]])
T = torch.tensor([[-1.5, -0.5, -2.0], [-1.2, -1.0, -PAD], [-1.0, -0.1, -0.6]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1]])
A = torch.tensor([[0.7, 0.7, 0.7], [-0.7, -0.7, PAD], [0.0, PAD, 0.0]])


def rows(t: torch.Tensor) -> list:
    return [pytest.approx(r, abs=1e-6) for r in t.tolist()]


def test_reverse_kl_is_student_minus_teacher_on_response_tokens():
    assert reverse_kl(S, T, MASK).tolist() == rows(torch.tensor([[1.0, -0.5, 0.0], [1.0, -2.0, 0.0], [0.0, 0.0, 0.5]]))


def test_opd_plus_rl_subtracts_the_scaled_reverse_kl_from_the_advantage():
    adv, d = opd_advantages(A, S, T, MASK, kl_coef=0.5, use_task_rewards=True)
    expected = [[0.2, 0.95, 0.7], [-1.2, 0.3, 0.0], [0.0, 0.0, -0.25]]
    assert adv.tolist() == rows(torch.tensor(expected))
    # negative control: the sign flipped (teacher - student, a forward-looking mistake) gives other numbers
    wrong = torch.where(MASK.bool(), A + 0.5 * (S - T), 0.0)
    assert not torch.allclose(adv, wrong)
    assert d.tolist() == rows(torch.tensor([[1.0, -0.5, 0.0], [1.0, -2.0, 0.0], [0.0, 0.0, 0.5]]))


def test_pure_opd_ignores_the_task_advantage():
    adv, _ = opd_advantages(A, S, T, MASK, kl_coef=0.5, use_task_rewards=False)
    assert adv.tolist() == rows(torch.tensor([[-0.5, 0.25, 0.0], [-0.5, 1.0, 0.0], [0.0, 0.0, -0.25]]))
    # negative control: a teacher equal to the student gives no signal at all
    same, d = opd_advantages(A, S, S, MASK, kl_coef=0.5, use_task_rewards=False)
    assert same.abs().max().item() == 0.0 and d.abs().max().item() == 0.0


def test_metrics_over_the_response_tokens():
    _, d = opd_advantages(A, S, T, MASK, kl_coef=0.5, use_task_rewards=True)
    m = opd_metrics(d, T, MASK)
    assert m["opd/reverse_kl_mean"] == pytest.approx(0.0, abs=1e-7)
    assert m["opd/teacher_log_prob_mean"] == pytest.approx(-7.8 / 7)
    assert m["opd/coverage"] == 1.0


def test_tokens_the_teacher_did_not_score_carry_no_signal_and_lower_the_coverage():
    scored = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1]])  # row 0's last token unscored
    adv, d = opd_advantages(A, S, T, MASK, kl_coef=0.5, use_task_rewards=True, teacher_mask=scored)
    assert adv[0].tolist() == rows(torch.tensor([0.2, 0.95, 0.7]))  # 0.7: the task advantage alone
    m = opd_metrics(d, T, MASK, scored)
    assert m["opd/coverage"] == pytest.approx(6 / 7)
    assert m["opd/reverse_kl_mean"] == pytest.approx((1 - 0.5 + 1 - 2 + 0 + 0.5) / 6)
    assert m["opd/teacher_log_prob_mean"] == pytest.approx((-1.5 - 0.5 - 1.2 - 1 - 1 - 0.6) / 6)


def test_no_gradient_flows_through_the_signal():
    student = S.clone().requires_grad_(True)
    adv, d = opd_advantages(A, student, T, MASK, kl_coef=1.0, use_task_rewards=False)
    assert not adv.requires_grad and not d.requires_grad


def test_at_a_rollout_temperature_not_1_both_sides_of_the_signal_are_the_models_own():
    """One sampled token (id 0) of a 2-token vocabulary, the student's logits [2, 0], sampled at
    rollout temperature 0.5. Row 0's teacher is the student itself; row 1's has logits [0, 0]. By
    hand (nats):
        student at T = 0.5  log softmax([4, 0])[0] = -log(1 + e^-4) = -0.0181499 (the old log-prob)
        student at T = 1    log softmax([2, 0])[0] = -log(1 + e^-2) = -0.1269280
        teacher, row 0      the student's, at T = 1 (an SGLang teacher's only)   = -0.1269280
        teacher, row 1      log softmax([0, 0])[0] = -log 2                      = -0.6931472
    Pure OPD, kl_coef 1: A' = -(student at 1 - teacher) = [0, -0.5662192]; a student distilled from
    itself gets no signal. The old mix (student at T = 0.5, teacher at 1) gave row 0 -0.1087781."""
    from megarl.config import load_config
    from megarl.data.batch import Batch
    from megarl.trainer.experience import distill

    batch = Batch.from_token_lists([[1], [1]], [[0], [0]])
    batch["advantages"] = torch.tensor([[0.3], [0.3]])
    batch["old_log_probs"] = torch.full((2, 1), -math.log1p(math.exp(-4)))  # at T = 0.5: the PPO ratio's
    batch["opd_student_log_probs"] = torch.full((2, 1), -math.log1p(math.exp(-2)))  # at T = 1
    batch["teacher_log_probs"] = torch.tensor([[-math.log1p(math.exp(-2))], [-math.log(2)]])
    config = load_config(None, ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/models/m",
                                "distillation.enabled=true", "distillation.use_task_rewards=false",
                                "actor_rollout_ref.rollout.temperature=0.5"])
    metrics = distill(batch, config)
    assert batch["advantages"][:, 0].tolist() == [pytest.approx(0.0, abs=1e-7), pytest.approx(-0.5662192, abs=1e-6)]
    assert metrics["opd/reverse_kl_mean"] == pytest.approx(0.5662192 / 2, abs=1e-6)


def test_the_student_needs_a_pass_of_its_own_only_where_the_rollout_temperature_is_not_1():
    from megarl.algos.opd import OPD_TEMPERATURE, student_needs_own_pass

    assert OPD_TEMPERATURE == 1.0
    assert student_needs_own_pass(0.5) and student_needs_own_pass(1.5) and student_needs_own_pass(0.999)
    assert not student_needs_own_pass(1.0)


def test_forward_kl_topk_through_the_policy_gradient_by_hand():
    """`experience.distill` with distillation.loss_mode=forward_kl_topk, use_policy_gradient=true, top 2,
    kl_coef 0.5, use_task_rewards=true and both clamps. One token; the teacher's top 2 at log-probs
    [log 0.7, log 0.2], the student's at those ids [log 0.5, log 1e-6] (floored at -10 to log e^-10):
        l = 0.7 (log 0.7 - log 0.5) + 0.2 (log 0.2 + 10) = 0.2355306 + 1.6781124 = 1.9136430,
    clamped to loss_max_clamp 1.5: A' = 0.3 - 0.5 x 1.5 = -0.45. Without the floor l = 2.6, also
    clamped; loss_max_clamp 3 gives 0.3 - 0.5 x 1.9136430 = -0.6568215."""
    from megarl.config import load_config
    from megarl.data.batch import Batch
    from megarl.trainer.experience import distill

    def advantage(loss_max_clamp):
        batch = Batch.from_token_lists([[1]], [[0]])
        batch["advantages"] = torch.tensor([[0.3]])
        batch["opd_student_log_probs"] = torch.tensor([[math.log(0.5)]])
        batch["teacher_log_probs"] = torch.tensor([[math.log(0.7)]])
        batch["teacher_topk_log_probs"] = torch.tensor([[[math.log(0.7), math.log(0.2)]]])
        batch["opd_student_topk_log_probs"] = torch.tensor([[[math.log(0.5), math.log(1e-6)]]])
        config = load_config(None, ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/models/m",
                                    "distillation.enabled=true", "distillation.loss_mode=forward_kl_topk",
                                    "distillation.topk=2", "distillation.kl_coef=0.5",
                                    f"distillation.loss_max_clamp={loss_max_clamp}",
                                    "distillation.log_prob_min_clamp=-10"])
        metrics = distill(batch, config)
        assert metrics["opd/reverse_kl_mean"] == pytest.approx(math.log(0.5) - math.log(0.7), abs=1e-6)  # k1 still
        return batch["advantages"][0, 0].item()

    assert advantage(1.5) == pytest.approx(-0.45, abs=1e-6)
    assert advantage(3.0) == pytest.approx(0.3 - 0.5 * 1.9136430, abs=1e-6)
