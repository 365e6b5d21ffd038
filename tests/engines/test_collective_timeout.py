"""actor_rollout_ref.nccl_timeout reaches the groups for real: in a 2-rank gloo world joined as a
training worker joins it and with megatron's groups built by the engine, a rank that never enters
a collective makes its peer's all-reduce fail after the key's seconds, on megatron's
tensor-parallel group and on the world alike, not after megatron's 30 minutes or the join's bound."""
import inspect

from collective_timeout_world import JOIN_TIMEOUT_S, timeout_world

from megarl.config import load_config
from megarl.data.tiny_model import make_tiny_model
from megarl.testing import run_gloo_workers

NCCL_TIMEOUT_S = 3


def test_the_schema_default_is_megatron_cores_own_default():
    from megatron.core import parallel_state

    minutes = inspect.signature(parallel_state.initialize_model_parallel).parameters["distributed_timeout_minutes"]
    assert minutes.default == 30
    assert load_config(None, []).actor_rollout_ref.nccl_timeout == minutes.default * 60


def test_a_peer_that_never_enters_a_collective_fails_it_after_the_keys_seconds(tmp_path):
    model = make_tiny_model("qwen2", tmp_path / "qwen2", seed=0, layers=2, hidden=32, heads=4, kv_heads=2)
    ranks = run_gloo_workers(timeout_world, 2, args=(str(model), float(NCCL_TIMEOUT_S)), timeout_s=240)
    assert ranks[1] == {}
    assert set(ranks[0]) == {"tensor_model_parallel", "world"}
    for group, (seconds, error) in ranks[0].items():
        assert error is not None, f"{group}: the all-reduce returned although rank 1 never entered it"
        # gloo names the bound it waited for: the key's 3 s, not megatron's 30 min nor the 60 s join
        assert f"Timed out waiting {NCCL_TIMEOUT_S * 1000}ms" in error, (group, error)
        assert NCCL_TIMEOUT_S - 0.5 < seconds < min(20.0, JOIN_TIMEOUT_S), (group, seconds, error)
