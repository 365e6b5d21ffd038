"""`make demo`: the CPU quickstart, run as far as this build of megarl goes.

Today that is the experiment config: configs/quickstart.yaml is loaded, validated and its step
plan printed. Each later stage (tiny model, data, RL loop) extends this module as it lands.
"""
from __future__ import annotations

import sys
from pathlib import Path

from megarl.config import load_and_validate, to_yaml
from megarl.config.args import entry_point
from megarl.trainer.main_ppo import describe

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


@entry_point
def main() -> int:
    config = load_and_validate(QUICKSTART)
    print(f"== resolved config: {QUICKSTART}")
    print(to_yaml(config))
    print("== plan")
    print(describe(config))
    print("\nThe tiny model, the synthetic data and the RL loop are not in this build yet: the demo stops here.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
