"""Rules on the rollout-mismatch corrections (`algorithm.rollout_correction`, verl 0.9.1's keys) and
how they sit with the actor's own `tis_imp_ratio_cap`, `use_rollout_log_probs` and policy loss; the
parsers of their threshold strings."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Optional

from megarl.config.rules.common import DerivedSizes
from megarl.config.schema import ExperimentConfig

KEY = "algorithm.rollout_correction"
# verl 0.9.1's SUPPORTED_ROLLOUT_RS_OPTIONS (megarl.algos.rollout_correction.rejection_mask)
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def parse_band(spec: str, *, reciprocal: bool) -> tuple[Optional[float], float]:
    """A threshold string as verl writes it -> (lower, upper) bounds of the ratio rho.
    "lower_upper" gives both (YAML, as Hydra, reads digits joined by "_" as one number: 0.5_2 is
    0.52 and 1_2 is 12 before this sees them, so a band needs a decimal point in its upper bound:
    0.5_2.0, 1.0_2.0); a lone number U gives (1/U, U) with `reciprocal` (verl's
    rollout_rs_threshold), else (None, U) (rollout_is_threshold: the TIS cap). Raises ValueError
    saying what is wrong: not numbers, a bound <= 0, lower > 1 or upper < 1 (a band without 1 would
    drop every token on which trainer and rollout agree)."""
    parts = str(spec).strip().split("_")
    if len(parts) > 2:
        raise ValueError("must be a number or 'lower_upper'")
    try:
        numbers = [float(p) for p in parts]
    except ValueError:
        raise ValueError("must be a number or 'lower_upper' (e.g. 0.5_2.0)") from None
    if any(n <= 0 for n in numbers):
        raise ValueError("bounds must be > 0")
    upper = numbers[-1]
    if len(numbers) == 1 and upper < 1:
        raise ValueError(f"{'the upper bound' if reciprocal else 'a cap'} must be >= 1 (a band is written "
                         "with a decimal point in both bounds, e.g. 0.5_2.0: YAML reads 0.5_2 as the number 0.52)")
    lower = numbers[0] if len(numbers) == 2 else (1.0 / upper if reciprocal else None)
    if upper < 1 or (lower is not None and lower > 1):
        raise ValueError("the band must hold 1 (lower <= 1 <= upper)")
    return lower, upper


def parse_rejection(options: str, thresholds: Optional[str]) -> list[tuple[str, Optional[float], float]]:
    """verl's `rollout_rs` and `rollout_rs_threshold` -> [(option, lower, upper)], the argument of
    `megarl.algos.rollout_correction.rejection_mask`. `options` is comma-separated (repeats dropped,
    the order kept); `thresholds` one spec for every option or one per option, comma-separated: a
    k1 option's ratio band (`parse_band` with a lone U meaning [1/U, U]), a k2/k3 option's upper
    bound on its divergence (lower None), as verl's `_parse_rollout_rs_thresholds`. Raises
    ValueError saying which part is wrong."""
    names = list(dict.fromkeys(o.strip() for o in str(options).split(",") if o.strip()))
    if not names:
        raise ValueError("rollout_rs names no option")
    unknown = [n for n in names if n not in RS_OPTIONS]
    if unknown:
        raise ValueError(f"rollout_rs option {unknown[0]!r} is not one of {', '.join(RS_OPTIONS)}")
    specs = [t.strip() for t in str(thresholds).split(",") if t.strip()] if thresholds is not None else []
    if len(specs) not in (1, len(names)):
        raise ValueError(f"rollout_rs_threshold={thresholds!r} gives {len(specs)} thresholds for {len(names)} "
                         "options: give one for all or one per option, comma-separated")
    parsed = []
    for name, spec in zip(names, specs * len(names) if len(specs) == 1 else specs):
        if name.endswith("k1"):
            try:
                lower, upper = parse_band(spec, reciprocal=True)
            except ValueError as err:
                raise ValueError(f"rollout_rs_threshold {spec!r} of {name}: {err}") from None
        else:
            try:
                lower, upper = None, float(spec)
            except ValueError:
                raise ValueError(f"rollout_rs_threshold {spec!r} of {name}: an upper bound on its divergence, "
                                 "one number (k2/k3 options take no band)") from None
            if upper <= 0:
                raise ValueError(f"rollout_rs_threshold {spec!r} of {name}: must be > 0")
        parsed.append((name, lower, upper))
    return parsed


def rollout_correction_settings(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """The thresholds parse (`parse_band`, `parse_rejection`); batch normalisation has weights to
    normalise and happens where the whole batch is (not in bypass mode's loss, per micro-batch);
    `loss_type` is bypass mode's.

    Reads: algorithm.rollout_correction
    """
    rc = config.algorithm.rollout_correction
    if rc.rollout_is is not None:
        try:
            parse_band(rc.rollout_is_threshold, reciprocal=False)
        except ValueError as err:
            yield f"{KEY}.rollout_is_threshold={rc.rollout_is_threshold!r}: {err}"
    if rc.rollout_rs is not None:
        if rc.rollout_rs_threshold is None:
            yield (f"{KEY}.rollout_rs={rc.rollout_rs} needs {KEY}.rollout_rs_threshold "
                   "(a ratio band 'lower_upper', e.g. 0.5_2.0, for k1 options; an upper bound for k2/k3)")
        else:
            try:
                parse_rejection(rc.rollout_rs, rc.rollout_rs_threshold)
            except ValueError as err:
                yield f"{KEY}.rollout_rs={rc.rollout_rs!r}, {KEY}.rollout_rs_threshold={rc.rollout_rs_threshold!r}: {err}"
    if rc.rollout_is_batch_normalize and rc.rollout_is is None:
        yield (f"{KEY}.rollout_is_batch_normalize=true normalises importance weights, but {KEY}.rollout_is=null "
               "makes none; set rollout_is or false")
    if rc.rollout_is_batch_normalize and rc.bypass_mode:
        yield (f"{KEY}.rollout_is_batch_normalize=true with {KEY}.bypass_mode=true: bypass mode makes the weights "
               "per micro-batch inside the loss, where megarl does not normalise them (verl averages over the "
               "micro-batch across ranks); set one false")
    if rc.loss_type != "ppo_clip" and not rc.bypass_mode:
        yield (f"{KEY}.loss_type={rc.loss_type} is the loss of bypass mode ({KEY}.bypass_mode=true); "
               "decoupled mode uses the actor's policy loss: set loss_type=ppo_clip or bypass_mode=true")


def rollout_correction_fits_actor(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """Decoupled mode compares the trainer's old log-probs with the rollout's: with
    `use_rollout_log_probs` the rollout's are the old ones and every ratio is 1, so the pair is
    refused (as `rollout_log_probs_without_tis` refuses it for the cap). `tis_imp_ratio_cap` and
    `rollout_is` both weight each token's loss (the cap is `rollout_is=token` under its older
    name): one of them. Bypass mode makes the rollout's log-probs the old ones without a trainer
    pass: the cap would weigh every token by 1; distillation reads the trainer's log-probs of the
    batch from that pass. (Its loss replacing `policy_loss.loss_mode` is a warning:
    `bypass_replaces_loss_mode`.)

    Reads: algorithm.rollout_correction.rollout_is, algorithm.rollout_correction.rollout_rs,
    algorithm.rollout_correction.bypass_mode, actor_rollout_ref.actor.use_rollout_log_probs,
    actor_rollout_ref.actor.tis_imp_ratio_cap, distillation.enabled
    """
    rc, actor = config.algorithm.rollout_correction, config.actor_rollout_ref.actor
    on = [f"{KEY}.{name}={value}" for name, value in (("rollout_is", rc.rollout_is), ("rollout_rs", rc.rollout_rs))
          if value is not None]
    if rc.bypass_mode:
        if actor.tis_imp_ratio_cap > 0:
            yield (f"{KEY}.bypass_mode=true makes the rollout's log-probs the old ones: "
                   f"actor_rollout_ref.actor.tis_imp_ratio_cap={actor.tis_imp_ratio_cap} would weigh every token by 1; "
                   f"set it to -1 ({KEY}.rollout_is weights against the current policy there)")
        if config.distillation.enabled:
            yield (f"{KEY}.bypass_mode=true skips the trainer's log-prob pass that distillation.enabled=true "
                   "reads; turn one off")
        return
    if actor.use_rollout_log_probs and on:
        yield (f"{' and '.join(on)} compare the trainer's log-probs with the rollout's, but "
               "actor_rollout_ref.actor.use_rollout_log_probs=true makes the rollout's the old ones (every ratio 1); "
               f"turn one off, or set {KEY}.bypass_mode=true (corrections against the current policy)")
    if actor.tis_imp_ratio_cap > 0 and rc.rollout_is is not None:
        yield (f"actor_rollout_ref.actor.tis_imp_ratio_cap={actor.tis_imp_ratio_cap} and {KEY}.rollout_is="
               f"{rc.rollout_is} both weight each token's loss; set one (the cap C is "
               f"{KEY}.rollout_is=token with rollout_is_threshold=C)")


def bypass_replaces_loss_mode(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """A warning (megarl.config.rules.WARNING_RULES): bypass mode's loss (`loss_type`) replaces the
    actor's `policy_loss.loss_mode`, as verl 0.9.1's `apply_bypass_mode` sets loss_mode="bypass_mode"
    (trainer/ppo/rollout_corr_helper.py) and runs; a loss_mode other than vanilla is then not used.

    Reads: algorithm.rollout_correction.bypass_mode, algorithm.rollout_correction.loss_type,
    actor_rollout_ref.actor.policy_loss.loss_mode
    """
    rc, loss_mode = config.algorithm.rollout_correction, config.actor_rollout_ref.actor.policy_loss.loss_mode
    if rc.bypass_mode and loss_mode != "vanilla":
        yield (f"{KEY}.bypass_mode=true computes the policy loss by {KEY}.loss_type={rc.loss_type}, which "
               f"replaces actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode} (as verl's bypass mode "
               "does): that loss is not used; set bypass_mode=false to train with it")
