"""Rules on the rollout-mismatch corrections (`algorithm.rollout_correction`, verl 0.9.1's keys) and
how they sit with the actor's own `tis_imp_ratio_cap` and `use_rollout_log_probs`; the parser of
their threshold strings."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Optional

from megarl.config.rules.common import DerivedSizes
from megarl.config.schema import ExperimentConfig

KEY = "algorithm.rollout_correction"


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


def rollout_correction_settings(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """The thresholds parse (`parse_band`); masked IS has a band; a TIS cap is at least 1, as
    `actor_rollout_ref.actor.tis_imp_ratio_cap`'s; batch normalisation of the weights is not
    implemented.

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
                   "(a ratio band 'lower_upper', e.g. 0.5_2.0)")
        else:
            try:
                parse_band(rc.rollout_rs_threshold, reciprocal=True)
            except ValueError as err:
                yield f"{KEY}.rollout_rs_threshold={rc.rollout_rs_threshold!r}: {err}"
    if rc.rollout_is_batch_normalize:
        yield f"{KEY}.rollout_is_batch_normalize=true: megarl does not normalise the weights; set false"


def rollout_correction_fits_actor(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """A correction compares the trainer's old log-probs with the rollout's: with
    `use_rollout_log_probs` the rollout's are the old ones and every ratio is 1, so the pair is
    refused (as `rollout_log_probs_without_tis` refuses it for the cap). `tis_imp_ratio_cap` and
    `rollout_is` both weight each token's loss (the cap is `rollout_is=token` under its older
    name): one of them.

    Reads: algorithm.rollout_correction.rollout_is, algorithm.rollout_correction.rollout_rs,
    actor_rollout_ref.actor.use_rollout_log_probs, actor_rollout_ref.actor.tis_imp_ratio_cap
    """
    rc, actor = config.algorithm.rollout_correction, config.actor_rollout_ref.actor
    on = [f"{KEY}.{name}={value}" for name, value in (("rollout_is", rc.rollout_is), ("rollout_rs", rc.rollout_rs))
          if value is not None]
    if actor.use_rollout_log_probs and on:
        yield (f"{' and '.join(on)} compare the trainer's log-probs with the rollout's, but "
               "actor_rollout_ref.actor.use_rollout_log_probs=true makes the rollout's the old ones (every ratio 1); "
               "turn one off")
    if actor.tis_imp_ratio_cap > 0 and rc.rollout_is is not None:
        yield (f"actor_rollout_ref.actor.tis_imp_ratio_cap={actor.tis_imp_ratio_cap} and {KEY}.rollout_is="
               f"{rc.rollout_is} both weight each token's loss; set one (the cap C is "
               f"{KEY}.rollout_is=token with rollout_is_threshold=C)")
