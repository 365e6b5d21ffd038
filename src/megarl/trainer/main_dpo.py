"""`python -m megarl.trainer.main_dpo [--config X.yaml] [--dry-run] key.path=value ...`

Direct preference optimisation on the Megatron engine (see megarl.trainer.dpo); the same config
groups as main_ppo, with preference parquet files (`data.chosen_key` and `data.rejected_key`
columns) as data.train_files/val_files and the loss in `algorithm.dpo.*`.
"""
from __future__ import annotations

import sys

from megarl.config.args import entry_point
from megarl.trainer.offline import offline_main


@entry_point
def main(argv: list[str] | None = None) -> int:
    return offline_main("python -m megarl.trainer.main_dpo", __doc__, "megarl.trainer.dpo:run_dpo", argv, "dpo")


if __name__ == "__main__":
    sys.exit(main())
