"""`python -m megarl.trainer.sft_trainer ...`: verl's SFT entry point name (verl.trainer.sft_trainer)
for megarl.trainer.main_sft, megarl's supervised fine-tuning with megarl's config groups."""
from __future__ import annotations

import sys

from megarl.trainer.main_sft import main

if __name__ == "__main__":
    sys.exit(main())
