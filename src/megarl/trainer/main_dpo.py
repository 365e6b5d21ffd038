"""`python -m megarl.trainer.main_dpo [--config X.yaml] [--dry-run] key.path=value ...`

Direct preference optimisation on the Megatron engine (see megarl.trainer.dpo); the same config
groups as main_ppo, with preference parquet files (`data.chosen_key` and `data.rejected_key`
columns) as data.train_files/val_files and the loss in `algorithm.dpo.*`.
"""
from __future__ import annotations

import argparse
import sys

from megarl.config import load_and_validate
from megarl.config.args import add_experiment_args, entry_point
from megarl.trainer.preflight import check_environment


@entry_point
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megarl.trainer.main_dpo", description=__doc__)
    add_experiment_args(parser)
    parser.add_argument("--dry-run", action="store_true", help="stop after validating the config")
    args = parser.parse_intermixed_args(argv)
    config = load_and_validate(args.config, args.overrides)
    if args.dry_run:
        print("config OK (dry run: stopping after validation)")
        return 0
    check_environment(config)
    from megarl.trainer.dpo import run_dpo

    run_dpo(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
