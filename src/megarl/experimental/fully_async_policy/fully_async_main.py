"""`python -m megarl.experimental.fully_async_policy.fully_async_main [--dry-run] key.path=value ...`

verl's fully async trainer (verl.experimental.fully_async_policy.fully_async_main) with megarl:
async_training.mode=fully_async on split placement, with the defaults of verl's
fully_async_ppo_megatron_trainer.yaml (the rollout on rollout.nnodes x rollout.n_gpus_per_node GPUs of
its own, partial rollouts, the rollout's log-probs as the old ones); verl's async_training.* keys are
read as megarl.config.verl_compat._async says.
"""
from __future__ import annotations

import sys

from megarl.config.args import entry_point
from megarl.config.verl_compat import FULLY_ASYNC_DEFAULTS, FULLY_ASYNC_MODULE
from megarl.trainer.main_ppo import main_with_defaults


@entry_point
def main(argv: list[str] | None = None) -> int:
    return main_with_defaults(argv, FULLY_ASYNC_DEFAULTS, f"python -m {FULLY_ASYNC_MODULE}", __doc__)


if __name__ == "__main__":
    sys.exit(main())
