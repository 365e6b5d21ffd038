"""Shared fixtures of the end-to-end trainer tests: one tiny model and one synthetic dataset per
test session."""
import contextlib
import os
import sys
from pathlib import Path

import pytest
import ray

from megarl.data.synthetic import write_task_dataset
from megarl.data.tiny_model import make_tiny_model

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))  # the modules the tests share (sigmoid_moe.py)


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory) -> Path:
    """<root>/model: the tiny Qwen2 model (random, seed 0); <root>/data/{train,val}.parquet: the
    2-digit addition task (256 train, 16 validation prompts)."""
    root = tmp_path_factory.mktemp("tiny_assets")
    make_tiny_model("qwen2", root / "model", seed=0)
    write_task_dataset("add", root / "data", train_size=256, val_size=16, sft_size=0, seed=0)
    return root



@pytest.fixture(scope="module")
def ray_two_gpus(tmp_path_factory):
    """A local Ray cluster with 2 logical GPUs for this module's tests."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=str(tmp_path_factory.mktemp("ray")))
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def run_to_completion():
    """run(cmd, cwd, timeout_s, what) -> output: a trainer command in its own process session,
    killed as a group if it overruns (the test fails); it must exit 0 (`megarl.testing`)."""
    from megarl.testing import run_to_completion

    return run_to_completion


@pytest.fixture(scope="session")
def tiny_grpo_cluster():
    """The context manager below, for module fixtures that bring up a whole cluster."""
    return _tiny_grpo_cluster


@contextlib.contextmanager
def _tiny_grpo_cluster(tiny_assets: Path, out_dir: Path, *overrides: str):
    """(cluster, trainer) of configs/tiny/grpo.yaml on `tiny_assets` at TP=2 on two logical GPUs
    (set here: the config's own layout is one GPU; so a TP=2 actor and two colocated CPU-engine
    servers, which the fault tests need), 4 prompts per step, one server restart allowed, no
    validation set, torn down on exit; needs a Ray session with 2 GPUs (`ray_two_gpus`)."""
    from transformers import AutoTokenizer

    from megarl.config import load_and_validate
    from megarl.rewards.custom import select_score_fn
    from megarl.runtime.cluster import Cluster
    from megarl.trainer.rl import RLTrainer

    config = load_and_validate(str(REPO / "configs/tiny/grpo.yaml"), [
        f"actor_rollout_ref.model.path={tiny_assets / 'model'}",
        f"data.train_files={tiny_assets / 'data/train.parquet'}",
        "data.val_files=[]", f"trainer.default_local_dir={out_dir}", "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.max_server_restarts=1", "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", *overrides,
    ])
    c = config.custom_reward_function
    score_fn = select_score_fn(c.path, c.name, c.reward_kwargs)
    cluster = Cluster(config)
    try:
        yield cluster, RLTrainer(config, cluster, AutoTokenizer.from_pretrained(str(tiny_assets / "model")), score_fn)
    finally:
        cluster.shutdown()
