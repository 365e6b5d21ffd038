"""`python -m megarl.recipe.dapo.main_dapo [--config-name=dapo_megatron_trainer] [--dry-run] key.path=value ...`

verl-recipe's DAPO trainer (recipe.dapo.main_dapo: verl's PPO task runner with RayDAPOTrainer, whose one
difference from verl's trainer is DAPO's dynamic sampling, `algorithm.filter_groups`) with megarl's RL loop,
which samples so itself (megarl.algos.dapo). Its default config is verl-recipe's dapo_trainer.yaml:
DAPO's reward manager (overlong shaping off until `reward_kwargs.overlong_buffer_cfg.enable`), filter_groups
off until enabled, gen_batch_size = train_batch_size, project verl-dapo (megarl.config.verl_compat.DAPO_DEFAULTS).
"""
from __future__ import annotations

import sys

from megarl.config.args import entry_point
from megarl.config.verl_compat import DAPO_DEFAULTS, DAPO_MODULE
from megarl.trainer.main_ppo import main_with_defaults


@entry_point
def main(argv: list[str] | None = None) -> int:
    return main_with_defaults(argv, DAPO_DEFAULTS, f"python -m {DAPO_MODULE}", __doc__)


if __name__ == "__main__":
    sys.exit(main())
