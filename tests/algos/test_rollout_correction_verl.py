"""megarl's rollout corrections against verl 0.9.1's own code, run here on random and edge batches in
float64: every function of verl's rollout_corr_helper.py (importance weights, rejection masks, the
off-policy diagnostics, the batch function and how the trainer applies it), every preset of its
RolloutCorrectionConfig, its dumped config section and the bypass-mode losses of its core_algos.py,
each metric within 1e-6.

verl comes from its wheel (requirements/verl-oracle.lock, `make install-verl-oracle`, which `make
test` runs; $MEGARL_VERL_WHEEL or .verl-oracle/): its files are executed from the zip, verl's
source unchanged: rollout_corr_helper.py, trainer/config/algorithm.py and base_config.py whole; of
utils/torch_functional.py and trainer/ppo/core_algos.py the functions used (their modules import
verl's heavy dependencies). Only the containers the helper imports are stood in for (DataProto,
PolicyLossConfig, the actor config's attributes). Without the wheel every test fails naming the
make target.

megarl's two documented differences are checked as verl's code under megarl's rule: a k1 band
[lower, upper] on rho is verl's code with "1/upper_1/lower"; sequence statistics are verl's code on
the rows with a valid token (the random batches hold rows without one).
"""
import ast
import collections
import dataclasses
import math
import os
import sys
import types
import zipfile
from pathlib import Path
from typing import Any, Optional
from unittest import mock

import numpy
import pytest
import torch
import yaml

import megarl.config.rollout_correction_presets as presets
from megarl.algos.from_config import bypass_kwargs, rollout_correction_kwargs
from megarl.algos.losses import bypass_policy_loss
from megarl.algos.rollout_correction import (
    OWN_PREFIX,
    PREFIX,
    is_weights,
    offpolicy_metrics,
    rejection_mask,
    rollout_correction,
)
from megarl.config import load_and_validate
from megarl.config.rules.rollout_correction import parse_band, parse_rejection
from megarl.data.batch import Batch
from megarl.trainer import experience

REPO = Path(__file__).resolve().parents[2]
WHEEL = Path(os.environ.get("MEGARL_VERL_WHEEL") or REPO / ".verl-oracle" / "verl-0.9.1-py3-none-any.whl")
REQUIRED = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/models/m"]
RC = "algorithm.rollout_correction"
TOL = 1e-6


# ------------------------------------------------------------------ verl's code from its wheel
class DataProto:
    """verl.protocol.DataProto as the helper uses it: tensors under `batch`, `from_dict`, `union`."""

    def __init__(self, batch: dict):
        self.batch = batch

    @classmethod
    def from_dict(cls, tensors: dict) -> "DataProto":
        return cls(dict(tensors))

    def union(self, other: "DataProto") -> "DataProto":
        self.batch.update(other.batch)
        return self


class ActorConfig(types.SimpleNamespace):
    """The attributes of verl's ActorConfig its policy losses read."""

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


def _exec_functions(source: str, names: list[str], namespace: dict) -> None:
    """Execute the top-level functions `names` of `source` (verl's text, decorators dropped) in `namespace`."""
    picked = [node for node in ast.parse(source).body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert sorted(node.name for node in picked) == sorted(names)
    for node in picked:
        node.decorator_list = []
    exec(compile(ast.Module(body=picked, type_ignores=[]), "verl-0.9.1", "exec"), namespace)


def _module(name: str, modules: dict, source: Optional[str] = None, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    modules[name] = sys.modules[name] = module
    if source is not None:
        exec(compile(source, f"verl-0.9.1/{name}", "exec"), module.__dict__)
    return module


@pytest.fixture(scope="module")
def verl() -> types.SimpleNamespace:
    if not WHEEL.is_file():
        pytest.fail(f"verl 0.9.1's wheel is not at {WHEEL}: run `make install-verl-oracle` (or set MEGARL_VERL_WHEEL)")
    with zipfile.ZipFile(WHEEL) as wheel:
        def source(path: str) -> str:
            return wheel.read(f"verl/{path}").decode()

        modules: dict[str, types.ModuleType] = {}
        with mock.patch.dict(sys.modules):
            for package in ("verl", "verl.trainer", "verl.trainer.ppo", "verl.trainer.config", "verl.utils",
                            "verl.workers", "verl.workers.config"):
                _module(package, modules)
            functional = _module("verl.utils.torch_functional", modules, torch=torch)
            _exec_functions(source("utils/torch_functional.py"),
                            ["masked_sum", "masked_mean", "distributed_masked_mean"], functional.__dict__)
            _module("verl.protocol", modules, DataProto=DataProto)
            _module("verl.workers.config.actor", modules, PolicyLossConfig=dict)
            _module("verl.base_config", modules, source("base_config.py"))
            algorithm = _module("verl.trainer.config.algorithm", modules, source("trainer/config/algorithm.py"))
            helper = _module("verl.trainer.ppo.rollout_corr_helper", modules, source("trainer/ppo/rollout_corr_helper.py"))
            for name, module in modules.items():  # `import a.b.c as x` reads the parents' attributes
                parent, _, child = name.rpartition(".")
                if parent:
                    setattr(modules[parent], child, module)
        losses = {"torch": torch, "verl_F": functional, "Optional": Optional, "Any": Any, "ActorConfig": object,
                  "AlgoConfig": type("AlgoConfig", (), {}), "DictConfig": type("DictConfig", (), {}), "np": numpy,
                  "defaultdict": collections.defaultdict}
        _exec_functions(source("trainer/ppo/core_algos.py"), [
            "agg_loss", "compute_policy_loss_vanilla", "compute_policy_loss_reinforce",
            "compute_policy_loss_bypass_mode", "compute_gpg_outcome_advantage",
            *(f"compute_policy_loss_{mode}" for mode in ("gpg", "dppo_tv", "dppo_kl", "sapo", "cispo", "clip_cov",
                                                         "kl_cov", "geo_mean", "dro"))],
            losses)  # GPG, DPPO and the other loss modes: test_losses_verl.py
        dumped = yaml.safe_load(source("trainer/config/_generated_ppo_megatron_trainer.yaml"))
    return types.SimpleNamespace(helper=helper, config=algorithm.RolloutCorrectionConfig, losses=losses,
                                 modules=modules, dumped=dumped)


# ------------------------------------------------------------------ batches and comparisons
def random_batch(seed: int, scale: float = 0.3, rows: int = 12, width: int = 9, empty_rows: bool = True):
    """(old, rollout, mask): log-probs [rows, width] float64, finite everywhere, old - rollout
    ~ N(0, scale) per token; two tokens 30 and 25 nats off (clamped at +-20 by both); with
    `empty_rows`, rows 2 and 7 hold no valid token; mask int64 as megarl's batches."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, width + 1, (rows,), generator=g)
    if empty_rows:
        lengths[[2, 7]] = 0
    mask = (torch.arange(width)[None, :] < lengths[:, None]).long()
    old = -3.0 * torch.rand(rows, width, generator=g, dtype=torch.float64)
    rollout = old - scale * torch.randn(rows, width, generator=g, dtype=torch.float64)
    rollout[0, 0], rollout[3, 1] = old[0, 0] + 30.0, old[3, 1] - 25.0
    return old, rollout, mask


def valid_rows(*tensors: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """megarl's rule for sequence statistics: the rows with a valid token."""
    rows = mask.bool().any(-1)
    return [t[rows] for t in tensors]


def verls_names(metrics: dict) -> dict:
    return {name: value for name, value in metrics.items() if not name.startswith(OWN_PREFIX)}


def assert_same_metrics(ours: dict, theirs: dict) -> None:
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        value = float(value)
        assert ours[name] == value or math.isclose(ours[name], value, rel_tol=TOL, abs_tol=TOL), (
            name, ours[name], value)


def verl_threshold(rejection: list) -> str:
    """verl's rollout_rs_threshold doing what megarl's parsed options do: a k1 band reflected
    (megarl keeps lower <= rho <= upper, verl's code 1/upper <= rho <= 1/lower)."""
    return ",".join(f"{1 / upper!r}_{1 / lower!r}" if name.endswith("k1") else f"{upper!r}"
                    for name, lower, upper in rejection)


def verl_section(cfg) -> dict:
    """A megarl section as verl's keyword arguments, under megarl's k1 rule."""
    rs_threshold = cfg.rollout_rs_threshold
    if cfg.rollout_rs is not None:
        rs_threshold = verl_threshold(parse_rejection(cfg.rollout_rs, cfg.rollout_rs_threshold))
    return {"rollout_is": cfg.rollout_is, "rollout_is_threshold": cfg.rollout_is_threshold,
            "rollout_is_batch_normalize": cfg.rollout_is_batch_normalize, "rollout_rs": cfg.rollout_rs,
            "rollout_rs_threshold": rs_threshold}


# ------------------------------------------------------------------ the helper's functions
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("threshold", ["2.0", "1.5", "0.5_5.0", "0.8_1.25"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("seed", [0, 1])
def test_importance_weights_and_their_metrics_are_verls(verl, seed, level, threshold, normalize):
    old, rollout, mask = random_batch(seed, scale=0.1)
    log_ratio = old - rollout
    lower, upper = parse_band(threshold, reciprocal=False)
    weights, metrics = is_weights(log_ratio, mask, level, lower, upper, normalize)
    theirs, _ = verl.helper.compute_rollout_correction_weights(log_ratio, mask.double(), level, threshold, normalize)
    torch.testing.assert_close(weights, theirs, rtol=TOL, atol=TOL)
    assert (weights[mask.bool()] > 0).any()
    _, their_metrics = verl.helper.compute_rollout_correction_weights(
        *valid_rows(log_ratio, mask.double(), mask=mask), level, threshold, normalize)
    assert_same_metrics(verls_names(metrics), their_metrics)


REJECTIONS = [(option, spec) for option in ("token_k1", "seq_sum_k1", "seq_mean_k1") for spec in ("0.5_2.0", "0.7_1.8", "3")]
REJECTIONS += [("token_k2", "0.05"), ("token_k3", "0.04"), ("seq_sum_k2", "0.3"), ("seq_sum_k3", "0.3"),
               ("seq_mean_k2", "0.05"), ("seq_mean_k3", "0.04"), ("seq_max_k2", "0.1"), ("seq_max_k3", "0.1"),
               ("token_k1,seq_mean_k3", "0.7_1.8,0.05"),  # verl's decoupled_k3_rs_token_tis-like chain
               ("seq_sum_k1,seq_max_k2,token_k3,seq_sum_k1", "0.6_1.9,0.1,0.04"),  # a repeat dropped
               ("token_k2,seq_mean_k1", "2.5")]  # one threshold for both


@pytest.mark.parametrize("options, spec", REJECTIONS)
@pytest.mark.parametrize("seed", [0, 1])
def test_rejection_masks_and_their_metrics_are_verls(verl, seed, options, spec):
    old, rollout, mask = random_batch(seed)
    log_ratio = old - rollout
    parsed = parse_rejection(options, spec)
    keep, metrics = rejection_mask(log_ratio, mask, parsed)
    theirs, _ = verl.helper.compute_rollout_rejection_mask(log_ratio, mask.double(), options, verl_threshold(parsed))
    assert torch.equal(keep, theirs.bool())
    assert 0 < keep.sum() < mask.sum(), "the threshold should keep some tokens and drop others"
    _, their_metrics = verl.helper.compute_rollout_rejection_mask(
        *valid_rows(log_ratio, mask.double(), mask=mask), options, verl_threshold(parsed))
    assert_same_metrics(metrics, their_metrics)


@pytest.mark.parametrize("scale", [0.05, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_off_policy_diagnostics_are_verls(verl, seed, scale):
    old, rollout, mask = random_batch(seed, scale)
    theirs = verl.helper.compute_rollout_corr_metrics_from_logprobs(*valid_rows(old, rollout, mask.double(), mask=mask))
    assert_same_metrics(offpolicy_metrics(old, rollout, mask), theirs)


PRESETS = ["decoupled_token_is", "decoupled_seq_is", "decoupled_token_icepop", "decoupled_seq_is_rs",
           "decoupled_geo_rs", "decoupled_geo_rs_seq_tis", "decoupled_geo_rs_token_tis", "decoupled_k3_rs",
           "decoupled_k3_rs_seq_tis", "decoupled_k3_rs_token_tis", "bypass_ppo_clip", "bypass_ppo_clip_geo_rs",
           "bypass_ppo_clip_k3_rs", "bypass_pg_is", "bypass_pg_token_icepop", "bypass_pg_geo_rs",
           "bypass_pg_geo_rs_seq_tis", "bypass_pg_geo_rs_token_tis", "disabled"]


def test_megarl_has_every_preset_of_verls(verl):
    theirs = {name for name, value in vars(verl.config).items() if isinstance(value, classmethod)}
    assert theirs == set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_each_preset_is_verls_and_computes_as_verls(verl, name):
    """The preset's keys equal verl's (thresholds as the strings megarl holds), it validates, and the
    batch function (weights, mask, every metric and diagnostic) gives verl's
    `compute_rollout_correction_and_rejection_mask` on a batch whose ratios sit near 1 (noise 0.002
    nats per token, so verl's 0.1% geometric band keeps some rows)."""
    ours, theirs = getattr(presets, name)(), getattr(verl.config, name)()
    section = {f.name: getattr(ours, f.name) for f in dataclasses.fields(ours)}
    as_verls = {key: (None if value is None else str(value)) if key.endswith("threshold") else value
                for key, value in dict(theirs).items() if key != "_target_"}
    assert section == as_verls
    load_and_validate(None, REQUIRED + [f"{RC}.{key}={'null' if value is None else value}"
                                        for key, value in section.items()])
    old, rollout, mask = random_batch(3, scale=0.002)
    weights, keep, metrics = rollout_correction(old, rollout, mask, **rollout_correction_kwargs(ours))
    metrics.update(offpolicy_metrics(old, rollout, mask))
    their_weights, their_mask, _ = verl.helper.compute_rollout_correction_and_rejection_mask(
        old, rollout, mask.double(), **verl_section(ours))
    assert torch.equal(keep, their_mask.bool())
    if ours.rollout_is is None:
        assert weights is None and their_weights is None
    else:
        torch.testing.assert_close(weights.double(), their_weights.batch["rollout_is_weights"], rtol=TOL, atol=TOL)
    _, _, their_metrics = verl.helper.compute_rollout_correction_and_rejection_mask(
        *valid_rows(old, rollout, mask.double(), mask=mask), **verl_section(ours))
    assert_same_metrics(verls_names(metrics), their_metrics)


def test_the_trainer_applies_the_correction_to_the_batch_as_verls(verl):
    """verl's `compute_rollout_correction_and_add_to_batch` and megarl's `experience.rollout_correction`
    leave the same response_mask and rollout_is_weights in the batch (megarl keeps the read tokens in
    response_attention_mask)."""
    old, rollout, mask = random_batch(4, scale=0.2)
    overrides = [f"{RC}.rollout_is=sequence", f"{RC}.rollout_is_threshold=3.0", f"{RC}.rollout_rs=token_k1,seq_max_k3",
                 f"{RC}.rollout_rs_threshold='0.7_1.8,0.3'"]
    config = load_and_validate(None, REQUIRED + overrides)
    batch = Batch({"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask})
    metrics = experience.rollout_correction(batch, config)
    theirs, their_metrics = verl.helper.compute_rollout_correction_and_add_to_batch(
        DataProto({"old_log_probs": old, "rollout_log_probs": rollout, "response_mask": mask.double()}),
        verl_section(config.algorithm.rollout_correction))
    assert torch.equal(batch["response_mask"], theirs.batch["response_mask"].long())
    assert 0 < batch["response_mask"].sum() < mask.sum()
    torch.testing.assert_close(batch["rollout_is_weights"].double(), theirs.batch["rollout_is_weights"],
                               rtol=TOL, atol=TOL)
    assert torch.equal(batch["response_attention_mask"], mask)
    diagnostics = offpolicy_metrics(old, rollout, mask)
    assert set(their_metrics) - set(diagnostics) == set(verls_names(metrics))


# ------------------------------------------------------------------ megarl's documented differences, shown real
def test_megarls_k1_band_is_verls_code_with_the_band_reflected(verl):
    old, rollout, mask = random_batch(5)
    log_ratio = old - rollout
    keep, _ = rejection_mask(log_ratio, mask, [("token_k1", 0.7, 1.8)])
    reflected, _ = verl.helper.compute_rollout_rejection_mask(log_ratio, mask.double(), "token_k1", f"{1 / 1.8!r}_{1 / 0.7!r}")
    as_written, _ = verl.helper.compute_rollout_rejection_mask(log_ratio, mask.double(), "token_k1", "0.7_1.8")
    rho = torch.exp(log_ratio)
    assert torch.equal(keep, mask.bool() & (rho >= 0.7) & (rho <= 1.8))  # the band on rho, as verl's docs
    assert torch.equal(keep, reflected.bool()) and not torch.equal(keep, as_written.bool())


def test_sequence_statistics_count_the_rows_with_a_valid_token_where_verls_count_every_row(verl):
    old, rollout, mask = random_batch(6)
    _, _, ours = rollout_correction(old, rollout, mask, rollout_is="sequence", is_upper=2.0,
                                    rejection=[("seq_sum_k1", 0.5, 2.0)])
    _, _, every_row = verl.helper.compute_rollout_correction_and_rejection_mask(
        old, rollout, mask.double(), rollout_is="sequence", rollout_is_threshold=2.0, rollout_rs="seq_sum_k1",
        rollout_rs_threshold="0.5_2.0")
    name = PREFIX + "rollout_rs_seq_masked_fraction"
    assert every_row[name] == pytest.approx(ours[name] * 10 / 12)  # 2 of the 12 rows are empty


def test_an_effective_sample_size_without_a_nonzero_weight_is_0_where_verl_divides_by_zero(verl):
    old, rollout, mask = random_batch(7, scale=0.01)
    _, metrics = is_weights(old - rollout, mask, "token", 1.5, 2.0)  # IcePop: every rho near 1 is below 1.5
    assert metrics["rollout_is_eff_sample_size"] == 0.0 and metrics["rollout_is_mean"] == 0.0
    with pytest.raises(ZeroDivisionError):
        verl.helper.compute_rollout_correction_weights(old - rollout, mask.double(), "token", "1.5_2.0")


# ------------------------------------------------------------------ bypass mode's loss
BYPASS = [("ppo_clip", {}), ("ppo_clip", {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": "0.05"}),
          ("reinforce", {"rollout_is": "sequence", "rollout_is_threshold": "2.0"}),
          ("reinforce", {"rollout_is": "token", "rollout_is_threshold": "0.5_5.0"}),
          ("reinforce", {"rollout_is": "token", "rollout_rs": "token_k1,seq_mean_k1",
                         "rollout_rs_threshold": "0.7_1.8,0.9_1.1"})]


@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("loss_type, section", BYPASS)
def test_the_bypass_loss_and_its_gradient_are_verls(verl, loss_type, section, loss_agg_mode):
    """verl's `compute_policy_loss_bypass_mode` on one micro-batch holding the whole mini-batch
    (its token and row counts passed as verl's engine passes them): the loss, its gradient with
    respect to the current log-probs, the policy-loss metrics and every rollout_corr metric."""
    rollout, current, mask = random_batch(8, scale=0.3, empty_rows=False)
    advantages = torch.randn(mask.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    overrides = [f"{RC}.bypass_mode=true", f"{RC}.loss_type={loss_type}"] + [
        f"{RC}.{key}='{value}'" for key, value in section.items()]
    cfg = load_and_validate(None, REQUIRED + overrides).algorithm.rollout_correction
    counts = {"num_tokens": float(mask.sum()), "num_seqs": float(mask.any(-1).sum())}

    log_prob = current.clone().requires_grad_(True)
    loss, metrics = bypass_policy_loss(rollout, log_prob, advantages, mask, **bypass_kwargs(cfg), clip_ratio_low=0.2,
                                       clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=loss_agg_mode, **counts)
    loss.backward()

    their_log_prob = current.clone().requires_grad_(True)
    actor = ActorConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                        policy_loss={"rollout_correction": verl.config(**{**verl_section(cfg), "bypass_mode": True,
                                                                          "loss_type": loss_type})},
                        global_batch_info={"dp_size": 1, "batch_num_tokens": counts["num_tokens"],
                                           "global_batch_size": counts["num_seqs"]})
    with mock.patch.dict(sys.modules, verl.modules):
        their_loss, their_metrics = verl.losses["compute_policy_loss_bypass_mode"](
            rollout, their_log_prob, advantages, mask.double(), loss_agg_mode=loss_agg_mode, config=actor)
    their_loss.backward()

    assert loss.item() == pytest.approx(their_loss.item(), rel=TOL, abs=TOL)
    torch.testing.assert_close(log_prob.grad, their_log_prob.grad, rtol=TOL, atol=1e-9)
    assert metrics["ppo_kl"].item() == pytest.approx(their_metrics.pop("actor/ppo_kl"), rel=TOL, abs=TOL)
    if loss_type == "ppo_clip":
        assert metrics["pg_clipfrac"].item() == pytest.approx(their_metrics.pop("actor/pg_clipfrac"), abs=TOL)
        assert metrics["pg_clipfrac_dual"].item() == pytest.approx(their_metrics.pop("actor/pg_clipfrac_lower"), abs=TOL)
    corrections = {name: metrics[name].item() for name in metrics if name.startswith(PREFIX)}
    assert_same_metrics(corrections, their_metrics)


# ------------------------------------------------------------------ the config verl dumps
def test_verls_dumped_section_loads_with_verls_meaning(verl):
    """Every key of algorithm.rollout_correction in verl's generated megatron trainer config is a
    key of megarl's, and the dumped defaults load as megarl's defaults."""
    dumped = verl.dumped["algorithm"]["rollout_correction"]
    config = load_and_validate(None, REQUIRED + [f"{RC}.{key}={'null' if value is None else value}"
                                                 for key, value in dumped.items()])
    section = config.algorithm.rollout_correction
    assert set(dumped) == {f.name for f in dataclasses.fields(section)}
    assert {key: getattr(section, key) for key in dumped} == {
        key: str(value) if key == "rollout_is_threshold" else value for key, value in dumped.items()}
