"""Body of the distillation-loss engine check (test_distillation_engine.py), run in gloo
processes (2 ranks, TP=2: the vocabulary split over the ranks).

The teacher (`TeacherEngine.compute_teacher_top_k`) scores a batch's responses with its top-k
tokens; the actor then takes one update of pure forward_kl_topk distillation on them
(`update_policy`, use_policy_gradient=false, use_task_rewards=false, rollout temperature 0.7 so the
student's side takes its own pass at temperature 1), with both clamps. Ranks return the teacher's
top-k and the student's log-probs at them (output ranks), and the update's metrics.
"""
from __future__ import annotations

from engine_world import config, init_world, reset_layout, share_in_replica, training_batch

TOPK = 5
MIN_CLAMP = -3.9  # binds: the tiny random models' log-probs sit near log(1/47) = -3.85
MAX_CLAMP = 0.004


def distillation_config(models: dict):
    return config(models["qwen2"], 2, 2, 1, None, None,
                  "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1",
                  "actor_rollout_ref.rollout.temperature=0.7",
                  "distillation.enabled=true", f"distillation.teacher.model_path={models['qwen2_reseeded']}",
                  "distillation.teacher.megatron.tensor_model_parallel_size=2",
                  "distillation.loss_mode=forward_kl_topk", "distillation.use_policy_gradient=false",
                  "distillation.use_task_rewards=false", f"distillation.topk={TOPK}",
                  f"distillation.loss_max_clamp={MAX_CLAMP}", f"distillation.log_prob_min_clamp={MIN_CLAMP}")


def distillation_world(rank: int, world_size: int, port: int, models: dict) -> dict:
    init_world(rank, world_size, port)
    from megarl.engines.megatron.roles import ActorEngine, TeacherEngine

    cfg = distillation_config(models)
    batch = training_batch(1)
    teacher = TeacherEngine(cfg)
    scored = teacher.compute_teacher_top_k(batch, 1.0, TOPK)
    shared = share_in_replica(scored)
    del teacher
    reset_layout()
    actor = ActorEngine(cfg)
    for key in ("teacher_log_probs", "teacher_topk_log_probs", "teacher_topk_ids"):
        batch[key] = shared[key]
    batch["old_log_probs"] = share_in_replica(actor.compute_log_prob(batch, 0.7))["log_probs"]
    student_at_top_k = actor.compute_log_prob_at(batch, 1.0, "teacher_topk_ids")  # the policy-gradient form's
    metrics = actor.update_policy(batch)
    reset_layout()
    return {"scored": scored, "student_at_top_k": student_at_top_k, "metrics": metrics}
