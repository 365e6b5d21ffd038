"""Body of the reward-model engine check, run in gloo processes (see engine_world.py)."""
from __future__ import annotations

from engine_world import config, init_world, ragged_batch, reset_layout

RM_LAYOUTS = [(1, 1), (2, 1), (1, 2)]  # (TP, PP) on 2 ranks: DP2, TP2, PP2


def rm_config(rm_dir, world: int, tp: int, pp: int, micro_batch: int = 3):
    """The reward model `rm_dir` at TP x PP in fp32 (the policy is the same directory, so the
    tokenizers agree)."""
    return config(rm_dir, world, 1, 1, None, None, "reward_model.enable=true", f"reward_model.model.path={rm_dir}",
                  f"reward_model.micro_batch_size_per_gpu={micro_batch}",
                  f"reward_model.megatron.tensor_model_parallel_size={tp}",
                  f"reward_model.megatron.pipeline_model_parallel_size={pp}")


def reward_model_world(rank: int, world_size: int, port: int, rm_dir: str, size: int) -> dict:
    """Each layout of RM_LAYOUTS scores one ragged batch (each DP rank its slice): returns
    {(layout, dp_rank): [b] scores} from output ranks."""
    from megarl.engines.megatron.reward_model import RewardModelEngine

    init_world(rank, world_size, port)
    batch = ragged_batch(size, seed=3)
    out = {}
    for tp, pp in RM_LAYOUTS:
        engine = RewardModelEngine(rm_config(rm_dir, world_size, tp, pp))
        scored = engine.compute_rm_scores(batch.chunk(engine.dp_size)[engine.dp_rank])
        if scored is not None:
            out[((tp, pp), engine.dp_rank)] = scored["rm_scores"]
        del engine
        reset_layout()
    return out
