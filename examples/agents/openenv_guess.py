"""Episodes of an OpenEnv environment: examples/envs/openenv_guess.py, its server started by megarl on
127.0.0.1 when the run loads this file and stopped by its PID at exit (megarl.agents.openenv_env).
For your own environment, name its app (`package.module:app`, what openenv's create_app returned) and the
fields of its observation and action that hold text.

    actor_rollout_ref.rollout.agent.path=examples/agents/openenv_guess.py   (configs/tiny/agent_openenv.yaml)
"""
from pathlib import Path

from megarl.agents.openenv_env import OpenEnvConnector

env = OpenEnvConnector("openenv_guess:app", app_dir=str(Path(__file__).resolve().parents[1] / "envs"),
                       observation_field="prompt", action_field="message", max_steps=2)
run_episode = env.run_episode
