"""`python -m megarl.trainer.sft_trainer [--config X.yaml] [--dry-run] key.path=value ...`: verl's SFT
entry point (verl.trainer.sft_trainer) with verl's SFT keys: `model.*`, `engine.*`, `optim.*`,
`data.messages_key` chats, ... (megarl.config.verl_sft), run by megarl's supervised fine-tuning
(megarl.trainer.sft). Its data are chats (data.messages_key=messages), as verl's.
"""
from __future__ import annotations

import sys

from megarl.config.args import entry_point
from megarl.config.verl_compat import SFT_DEFAULTS, SFT_MODULE
from megarl.trainer.offline import offline_main


@entry_point
def main(argv: list[str] | None = None) -> int:
    return offline_main(f"python -m {SFT_MODULE}", __doc__, "megarl.trainer.sft:run_sft", argv, "sft",
                        defaults=SFT_DEFAULTS, verl_sft=True)


if __name__ == "__main__":
    sys.exit(main())
