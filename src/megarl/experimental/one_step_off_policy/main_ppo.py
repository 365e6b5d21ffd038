"""`python -m megarl.experimental.one_step_off_policy.main_ppo [--dry-run] key.path=value ...`

verl's one-step-off-policy trainer (verl.experimental.one_step_off_policy.main_ppo) with megarl:
async_training.mode=one_step_off (step k+1's batch generates with weights k while step k trains) on
split placement, with the defaults of verl's one_step_off_ppo_megatron_trainer.yaml (the rollout on
rollout.nnodes x rollout.n_gpus_per_node GPUs of its own, the rollout's log-probs as the old ones: verl's
algorithm.rollout_correction.bypass_mode=true).
"""
from __future__ import annotations

import sys

from megarl.config.args import entry_point
from megarl.config.verl_compat import ONE_STEP_OFF_DEFAULTS, ONE_STEP_OFF_MODULE
from megarl.trainer.main_ppo import main_with_defaults


@entry_point
def main(argv: list[str] | None = None) -> int:
    return main_with_defaults(argv, ONE_STEP_OFF_DEFAULTS, f"python -m {ONE_STEP_OFF_MODULE}", __doc__)


if __name__ == "__main__":
    sys.exit(main())
