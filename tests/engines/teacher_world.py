"""Body of the Megatron-teacher check, run in gloo processes (2 ranks): an on-policy
distillation teacher (a llama, untied) at TP2 x DP1 and its student (a qwen2) at TP1 x DP2, one
config, one world, one after the other as their worker groups would run them. Ranks return what
their output ranks scored and the layouts they ran at."""
from __future__ import annotations

from engine_world import TEMPERATURE, config, init_world, ragged_batch, reset_layout


def opd_config(models: dict, world_size: int):
    return config(models["qwen2"], world_size, 1, 1, None, None,
                  "distillation.enabled=true", f"distillation.teacher.model_path={models['llama']}",
                  "distillation.teacher.megatron.tensor_model_parallel_size=2",
                  "distillation.teacher.log_prob_micro_batch_size_per_gpu=3",
                  f"actor_rollout_ref.rollout.temperature={TEMPERATURE}")


def teacher_world(rank: int, world_size: int, port: int, models: dict) -> dict:
    from megarl.engines.megatron.roles import ActorEngine, TeacherEngine

    init_world(rank, world_size, port)
    batch, cfg, out = ragged_batch(8), opd_config(models, world_size), {}
    for role, build, score in (("teacher", TeacherEngine, "compute_teacher_log_prob"),
                               ("student", ActorEngine, "compute_log_prob")):
        engine = build(cfg)
        scored = getattr(engine, score)(batch.chunk(engine.dp_size)[engine.dp_rank], TEMPERATURE)
        out[role] = {"tp": engine._ps.get_tensor_model_parallel_world_size(), "dp": engine.dp_size,
                     "dp_rank": engine.dp_rank, "scored": scored}
        del engine
        reset_layout()
    return out
