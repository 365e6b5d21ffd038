"""Episodes of a verifiers environment: examples/envs/vf_spell.py (id `vf-spell`, two turns), loaded by verifiers'
own load_environment when the run loads this file (megarl.agents.verifiers_env); its rollout runs against megarl's
endpoint and its rubric scores each episode. For an installed environment, name its id and env_args (no env_dir).

    python examples/agents/verifiers_spell.py outputs/tiny/verifiers   # its dataset as train/val.parquet
    actor_rollout_ref.rollout.agent.path=examples/agents/verifiers_spell.py   (configs/tiny/agent_verifiers.yaml)
"""
import sys
from pathlib import Path

from megarl.agents.verifiers_env import VerifiersConnector

env = VerifiersConnector("vf-spell", env_args={"turns": 2, "size": 64, "eval_size": 8},
                         env_dir=str(Path(__file__).resolve().parents[1] / "envs"))
run_episode = env.run_episode

if __name__ == "__main__":
    env.write_dataset(sys.argv[1])
