"""verl 0.9.1's rollout-correction presets (`RolloutCorrectionConfig.decoupled_*`, `bypass_*`,
`disabled` in verl/trainer/config/algorithm.py) as megarl `algorithm.rollout_correction` sections:
the same names, arguments and defaults (tests/algos/test_rollout_correction_verl.py compares each
with verl's). In Python: `config.algorithm.rollout_correction = decoupled_seq_is_rs()`; in YAML or
overrides, the keys a preset sets (docs/rollout-correction.md lists them).

Decoupled presets keep the trainer's old log-probs (three policies: rollout, old, current); bypass
presets use the rollout's as the old ones (two policies) with `loss_type` ppo_clip or reinforce.
"""
from __future__ import annotations

from typing import Optional

from megarl.config.schema import RolloutCorrectionConfig

GEO_BAND = "0.999_1.001"  # verl's default band of the geometric-mean ratio (seq_mean_k1), +-0.1%


def _section(rollout_is: Optional[str] = None, is_threshold: float | str = 2.0, rollout_rs: Optional[str] = None,
             rs_threshold: Optional[float | str] = None, bypass_loss: Optional[str] = None) -> RolloutCorrectionConfig:
    """A section with verl's threshold values as megarl's strings; `bypass_loss` a loss_type turns
    bypass mode on."""
    return RolloutCorrectionConfig(
        rollout_is=rollout_is, rollout_is_threshold=str(is_threshold), rollout_rs=rollout_rs,
        rollout_rs_threshold=None if rs_threshold is None else str(rs_threshold),
        bypass_mode=bypass_loss is not None, loss_type=bypass_loss or "ppo_clip")


def decoupled_token_is(threshold: float = 2.0) -> RolloutCorrectionConfig:
    """Token-TIS."""
    return _section("token", threshold)


def decoupled_seq_is(threshold: float = 2.0) -> RolloutCorrectionConfig:
    """Seq-TIS."""
    return _section("sequence", threshold)


def decoupled_token_icepop(threshold: float = 5.0, threshold_lower: float = 0.5) -> RolloutCorrectionConfig:
    """Token-level IcePop on [threshold_lower, threshold]."""
    return _section("token", f"{threshold_lower}_{threshold}")


def decoupled_seq_is_rs(is_threshold: float = 2.0, rs_threshold: float | str = "0.5_2.0") -> RolloutCorrectionConfig:
    """Seq-MIS: Seq-TIS and rejection of rows by their ratio (seq_sum_k1)."""
    return _section("sequence", is_threshold, "seq_sum_k1", rs_threshold)


def decoupled_geo_rs(rs_threshold: float | str = GEO_BAND) -> RolloutCorrectionConfig:
    """Geo-RS: rejection of rows by their geometric-mean ratio (seq_mean_k1)."""
    return _section(None, 2.0, "seq_mean_k1", rs_threshold)


def decoupled_geo_rs_seq_tis(is_threshold: float = 2.0, rs_threshold: float | str = GEO_BAND) -> RolloutCorrectionConfig:
    """Geo-RS and Seq-TIS."""
    return _section("sequence", is_threshold, "seq_mean_k1", rs_threshold)


def decoupled_geo_rs_token_tis(is_threshold: float = 2.0, rs_threshold: float | str = GEO_BAND) -> RolloutCorrectionConfig:
    """Geo-RS and Token-TIS."""
    return _section("token", is_threshold, "seq_mean_k1", rs_threshold)


def decoupled_k3_rs(rs_threshold: float = 0.01) -> RolloutCorrectionConfig:
    """K3-RS: rejection of rows whose mean k3 divergence exceeds rs_threshold (seq_mean_k3)."""
    return _section(None, 2.0, "seq_mean_k3", rs_threshold)


def decoupled_k3_rs_seq_tis(is_threshold: float = 2.0, rs_threshold: float = 0.01) -> RolloutCorrectionConfig:
    """K3-RS and Seq-TIS."""
    return _section("sequence", is_threshold, "seq_mean_k3", rs_threshold)


def decoupled_k3_rs_token_tis(is_threshold: float = 2.0, rs_threshold: float = 0.01) -> RolloutCorrectionConfig:
    """K3-RS and Token-TIS."""
    return _section("token", is_threshold, "seq_mean_k3", rs_threshold)


def bypass_ppo_clip() -> RolloutCorrectionConfig:
    """Bypass, PPO-clip: the ratio to the rollout policy is the correction."""
    return _section(bypass_loss="ppo_clip")


def bypass_ppo_clip_geo_rs(rs_threshold: float | str = GEO_BAND) -> RolloutCorrectionConfig:
    """Bypass, PPO-clip and Geo-RS."""
    return _section(None, 2.0, "seq_mean_k1", rs_threshold, bypass_loss="ppo_clip")


def bypass_ppo_clip_k3_rs(rs_threshold: float = 0.01) -> RolloutCorrectionConfig:
    """Bypass, PPO-clip and K3-RS."""
    return _section(None, 2.0, "seq_mean_k3", rs_threshold, bypass_loss="ppo_clip")


def bypass_pg_is(threshold: float = 2.0) -> RolloutCorrectionConfig:
    """Bypass, REINFORCE with Seq-TIS weights."""
    return _section("sequence", threshold, bypass_loss="reinforce")


def bypass_pg_token_icepop(threshold: float = 5.0, threshold_lower: float = 0.5) -> RolloutCorrectionConfig:
    """Bypass, REINFORCE with token-level IcePop weights."""
    return _section("token", f"{threshold_lower}_{threshold}", bypass_loss="reinforce")


def bypass_pg_geo_rs(rs_threshold: float | str = GEO_BAND) -> RolloutCorrectionConfig:
    """Bypass, REINFORCE and Geo-RS."""
    return _section(None, 2.0, "seq_mean_k1", rs_threshold, bypass_loss="reinforce")


def bypass_pg_geo_rs_seq_tis(is_threshold: float = 2.0, rs_threshold: float | str = GEO_BAND) -> RolloutCorrectionConfig:
    """Bypass, REINFORCE with Seq-TIS weights and Geo-RS."""
    return _section("sequence", is_threshold, "seq_mean_k1", rs_threshold, bypass_loss="reinforce")


def bypass_pg_geo_rs_token_tis(is_threshold: float = 2.0, rs_threshold: float | str = GEO_BAND) -> RolloutCorrectionConfig:
    """Bypass, REINFORCE with Token-TIS weights and Geo-RS."""
    return _section("token", is_threshold, "seq_mean_k1", rs_threshold, bypass_loss="reinforce")


def disabled() -> RolloutCorrectionConfig:
    """No correction: the off-policy diagnostics only (logged on every run with rollout log-probs)."""
    return _section()
