"""`python -m megarl.trainer.main_sft [--config X.yaml] [--dry-run] key.path=value ...`

Supervised fine-tuning on the Megatron engine (see megarl.trainer.sft); the same config groups as
main_ppo, with SFT parquet files (a `data.response_key` column) as data.train_files/val_files.
"""
from __future__ import annotations

import sys

from megarl.config.args import entry_point
from megarl.trainer.offline import offline_main


@entry_point
def main(argv: list[str] | None = None) -> int:
    return offline_main("python -m megarl.trainer.main_sft", __doc__, "megarl.trainer.sft:run_sft", argv, "sft")


if __name__ == "__main__":
    sys.exit(main())
