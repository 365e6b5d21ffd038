"""megarl's distillation losses (megarl.algos.opd: `distillation.loss_mode`, the clamps) against verl
0.9.1's own code on random float32 tensors: every single-sample estimator
(`compute_distillation_loss_reverse_kl_estimator`), the top-k forward KL of verl's Megatron engine
(`_VocabParallelKLDivergence`, run on a one-rank gloo world with megatron-core's parallel state:
its losses, masses and its hand-written backward against autograd of megarl's), and verl's
`distillation_loss` / `distillation_ppo_loss` whole, for each mode, use_policy_gradient true and
false, use_task_rewards, loss_max_clamp and log_prob_min_clamp on and off, two loss_agg_modes
(the others' aggregation is verl's in test_losses_verl.py).
verl's files are executed from its wheel (the `verl` fixture of test_rollout_correction_verl.py);
the containers they import (TensorDict, Metric, the configs) are stood in for."""
import ast
import socket
import sys
import types
import zipfile
from pathlib import Path
from typing import Any, Optional
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from megarl.algos.kl import KL_ESTIMATORS
from megarl.algos.losses import policy_loss
from megarl.algos.opd import (
    advantages_with_loss,
    clamp_losses,
    direct_distillation_loss,
    estimator_losses,
    forward_kl_topk,
    opd_advantages,
)

sys.path.insert(0, str(Path(__file__).parent))
from test_rollout_correction_verl import WHEEL, ActorConfig, _module, verl  # noqa: E402,F401  (verl: the fixture)

RTOL, ATOL = 1e-5, 1e-6
VOCAB, K = 50, 6


class Metric:
    """verl.utils.metric.Metric as the losses build it."""

    def __init__(self, aggregation=None, value=None):
        self.aggregation, self.value = aggregation, value


class LossConfig(types.SimpleNamespace):
    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


def _exec_defs(source: str, names: list[str], namespace: dict) -> None:
    """Execute the top-level functions and classes `names` of verl's `source` (decorators dropped)."""
    picked = [n for n in ast.parse(source).body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name in names]
    assert sorted(n.name for n in picked) == sorted(names)
    for node in picked:
        node.decorator_list = []
    exec(compile(ast.Module(body=picked, type_ignores=[]), "verl-0.9.1", "exec"), namespace)


@pytest.fixture(scope="module")
def distill(verl) -> types.SimpleNamespace:
    """verl's distillation losses.py and megatron/losses.py, and a one-rank world for the latter."""
    with zipfile.ZipFile(WHEEL) as wheel:
        losses_src = wheel.read("verl/trainer/distillation/losses.py").decode()
        megatron_src = wheel.read("verl/trainer/distillation/megatron/losses.py").decode()
        core_src = wheel.read("verl/trainer/ppo/core_algos.py").decode()
    core = {"torch": torch}
    _exec_defs(core_src, ["kl_penalty", "kl_penalty_forward"], core)
    ns = {"torch": torch, "Any": Any, "Optional": Optional, "TensorDict": dict, "ActorConfig": object,
          "DistillationConfig": object, "DistillationLossConfig": object, "Metric": Metric,
          "AggregationType": types.SimpleNamespace(MIN="min", MAX="max", MEAN="mean", SUM="sum"),
          "kl_penalty": core["kl_penalty"], "agg_loss": verl.losses["agg_loss"],
          "no_padding_2_padding": lambda values, data: values,
          "get_policy_loss_fn": lambda name: verl.losses[f"compute_policy_loss_{name}"]}
    _exec_defs(losses_src, ["distillation_loss", "distillation_ppo_loss", "compute_forward_kl_topk",
                            "compute_distillation_loss_reverse_kl_estimator", "compute_distillation_loss_range"], ns)
    registry = {name: ns["compute_distillation_loss_reverse_kl_estimator"] for name in KL_ESTIMATORS}
    registry["forward_kl_topk"] = ns["compute_forward_kl_topk"]
    ns["get_distillation_loss_fn"] = registry.__getitem__
    ns["ppo_loss"] = lambda config, model_output, data, dp_group: (torch.tensor(0.25), {"actor/pg_loss": 0.25})
    mega = {}
    with mock.patch.dict(sys.modules):
        _module("verl.models", {}), _module("verl.models.mcore", {})
        _module("verl.models.mcore.util", {}, preprocess_bshd_engine=None, preprocess_thd_engine=None)
        _module("verl.workers.config", {}, DistillationConfig=object, DistillationLossConfig=object)
        exec(compile(megatron_src, "verl-0.9.1/megatron/losses.py", "exec"), mega)
    from megatron.core import parallel_state

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield types.SimpleNamespace(ns=ns, vocab_parallel_kl=mega["_VocabParallelKLDivergence"], verl=verl)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def random_case(seed: int, rows: int = 5, width: int = 7):
    """(student logits [rows, width, V] float32, teacher top-k (log-probs, ids) [rows, width, K],
    mask [rows, width], old log-probs [rows, width]): teacher log-probs of a sharper random model,
    some below -10 (the clamp binds), rows 1 without a valid token."""
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(rows, width, VOCAB, generator=g)
    teacher = torch.log_softmax(6.0 * torch.randn(rows, width, VOCAB, generator=g), -1)
    teacher_lp, teacher_ids = teacher.topk(K, -1)
    lengths = torch.randint(2, width + 1, (rows,), generator=g)
    lengths[1] = 0
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    old = torch.log_softmax(logits, -1).gather(-1, teacher_ids[..., :1]).squeeze(-1) + 0.1 * torch.randn(
        rows, width, generator=g)
    return logits, teacher_lp, teacher_ids, mask, old


def counts(mask):
    return {"num_tokens": float(mask.sum()), "num_seqs": float(mask.any(-1).sum())}


def verl_configs(mask, loss_agg_mode, **loss):
    n = counts(mask)
    info = {"dp_size": 1, "batch_num_tokens": n["num_tokens"], "global_batch_size": n["num_seqs"],
            "loss_scale_factor": None}
    actor = ActorConfig(loss_agg_mode=loss_agg_mode, loss_scale_factor=None, global_batch_info={}, clip_ratio=0.2,
                        clip_ratio_low=0.2, clip_ratio_high=0.2)
    loss_cfg = LossConfig(**{"clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2,
                             "policy_loss_mode": "vanilla", "global_batch_info": {}, "topk": K, **loss})
    data = {"response_mask": mask.bool(), "dp_size": 1, "batch_num_tokens": info["batch_num_tokens"],
            "global_batch_size": info["global_batch_size"]}
    return actor, types.SimpleNamespace(distillation_loss=loss_cfg), data


@pytest.mark.parametrize("mode", KL_ESTIMATORS)
@pytest.mark.parametrize("seed", [0, 1])
def test_estimator_losses_are_verls(distill, seed, mode):
    logits, _, _, mask, old = random_case(seed)
    student = torch.log_softmax(logits, -1)[..., 0]
    teacher = old - 1.5 * torch.rand(old.shape, generator=torch.Generator().manual_seed(seed))
    actor, config, data = verl_configs(mask, "token-mean", loss_mode=mode)
    data["teacher_logprobs"] = teacher.unsqueeze(-1)
    theirs, _ = distill.ns["compute_distillation_loss_reverse_kl_estimator"](actor, config, {"log_probs": student}, data)
    torch.testing.assert_close(estimator_losses(student, teacher, mode), theirs, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("log_prob_min_clamp", [None, -10.0, -3.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_forward_kl_topk_and_its_gradient_are_verls_megatron(distill, seed, log_prob_min_clamp):
    """Losses and masses of verl's Megatron function, and its hand-written backward (m_A p_j -
    q_j 1[j in A]) against autograd through megarl's, with student log-probs below the floor."""
    logits, teacher_lp, teacher_ids, _, _ = random_case(seed)
    theirs_in = logits.clone().requires_grad_(True)
    loss, s_mass, t_mass, *_ = distill.vocab_parallel_kl.apply(theirs_in, teacher_lp, teacher_ids, log_prob_min_clamp)
    weights = torch.rand(loss.shape, generator=torch.Generator().manual_seed(seed + 7))
    (loss * weights).sum().backward()
    ours_in = logits.clone().requires_grad_(True)
    student = torch.log_softmax(ours_in, -1).gather(-1, teacher_ids)
    if log_prob_min_clamp is not None:
        assert (student < log_prob_min_clamp).any() or log_prob_min_clamp == -10.0
    ours, ours_s_mass, ours_t_mass = forward_kl_topk(student, teacher_lp, log_prob_min_clamp)
    (ours * weights).sum().backward()
    positive = loss > 0  # verl's compute_forward_kl_topk floors at 0 after the Megatron function
    torch.testing.assert_close(ours, loss.clamp_min(0.0), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(ours_s_mass, s_mass, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(ours_t_mass, t_mass, rtol=RTOL, atol=ATOL)
    rows = positive.unsqueeze(-1).expand_as(logits)  # where the floor at 0 binds, megarl's gradient is 0
    assert positive.float().mean() > 0.5
    torch.testing.assert_close(ours_in.grad[rows], theirs_in.grad[rows], rtol=1e-4, atol=1e-6)


CASES = [  # (loss_mode, use_policy_gradient, loss_max_clamp, log_prob_min_clamp)
    *[(m, False, clamp, None) for m in ("abs", "k2", "mse", "k3", "low_var_kl", "kl") for clamp in (None, 0.05)
      if m != "kl"],
    *[(m, True, clamp, None) for m in KL_ESTIMATORS for clamp in (None, 0.05)],
    *[("forward_kl_topk", pg, max_clamp, min_clamp) for pg in (False, True)
      for max_clamp, min_clamp in ((None, None), (10.0, -10.0), (0.3, -3.0))],
]


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-sum-norm"])  # all: test_losses_verl.py
@pytest.mark.parametrize("use_task_rewards", [True, False])
@pytest.mark.parametrize("mode,use_pg,max_clamp,min_clamp", CASES)
def test_distillation_loss_is_verls(distill, mode, use_pg, max_clamp, min_clamp, use_task_rewards, loss_agg_mode):
    """verl's `distillation_ppo_loss` (policy loss stood in by 0.25) against megarl's parts: the
    direct term (`direct_distillation_loss` of the clamped losses) added to the policy loss times
    the coefficient with task rewards, alone without; the policy-gradient term verl adds is PPO's
    vanilla loss with the advantage -clamp(l), which megarl's `opd_advantages` (`advantages_with_loss` for
    forward_kl_topk) makes (use_task_rewards=false, kl_coef 1), through megarl's `policy_loss`."""
    logits, teacher_lp, teacher_ids, mask, old = random_case(3)
    student_full = torch.log_softmax(logits, -1)
    student = student_full[..., 0]
    teacher = teacher_lp[..., 0]
    coef = 0.7
    actor, config, data = verl_configs(mask, loss_agg_mode, loss_mode=mode, use_policy_gradient=use_pg,
                                       loss_max_clamp=max_clamp, log_prob_min_clamp=min_clamp,
                                       use_task_rewards=use_task_rewards, distillation_loss_coef=coef)
    data["old_log_probs"] = old
    model_output = {"log_probs": student}
    if mode == "forward_kl_topk":
        raw, s_mass, t_mass, *_ = distill.vocab_parallel_kl.apply(logits, teacher_lp, teacher_ids, min_clamp)
        model_output.update(distillation_losses=raw, student_mass=s_mass, teacher_mass=t_mass)
    else:
        data["teacher_logprobs"] = teacher.unsqueeze(-1)
    theirs, _ = distill.ns["distillation_ppo_loss"](actor, config, model_output, data)

    n = counts(mask)
    agg = dict(num_tokens=n["num_tokens"], num_seqs=n["num_seqs"])
    if mode == "forward_kl_topk":
        losses, _, _ = forward_kl_topk(student_full.gather(-1, teacher_ids), teacher_lp, min_clamp)
    else:
        losses = estimator_losses(student, teacher, mode)
    if use_pg and mode == "forward_kl_topk":
        advantages, _ = advantages_with_loss(torch.zeros_like(old), losses, mask, kl_coef=1.0, use_task_rewards=False,
                                             loss_max_clamp=max_clamp)
        term, _ = policy_loss(old, student, advantages, mask, loss_agg_mode=loss_agg_mode, **agg)
    elif use_pg:
        advantages, _ = opd_advantages(torch.zeros_like(old), student, teacher, mask, kl_coef=1.0,
                                       use_task_rewards=False, loss_mode=mode, loss_max_clamp=max_clamp)
        term, _ = policy_loss(old, student, advantages, mask, loss_agg_mode=loss_agg_mode, **agg)
    else:
        term = direct_distillation_loss(clamp_losses(losses, max_clamp), mask, loss_agg_mode, **agg)
    ours = 0.25 + coef * term if use_task_rewards else term
    torch.testing.assert_close(torch.as_tensor(ours, dtype=torch.float32), torch.as_tensor(theirs, dtype=torch.float32),
                               rtol=RTOL, atol=ATOL)
    assert float(term) != 0.0
    if max_clamp is not None and max_clamp < 1:  # the clamp binds somewhere: without it the term differs
        unclamped = estimator_losses(student, teacher, mode) if mode != "forward_kl_topk" else losses
        assert (unclamped[mask.bool()].abs() > max_clamp).any()
