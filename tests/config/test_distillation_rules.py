"""distillation.* at load time: its refusals one by one (each naming its keys), what it allows, and
what it changes elsewhere (the pools, the old log-probs' pass)."""
import logging

import pytest

from megarl.config.rules.common import DerivedSizes
from megarl.placement.from_config import plan_from_config
from megarl.trainer.experience import old_log_probs_in_update

from config_cases import fails, ok

ON = ["distillation.enabled=true", "distillation.teacher.model_path=/models/teacher"]
SGLANG = ON + ["distillation.type=sglang", "distillation.teacher.url=http://teacher:30000"]


@pytest.mark.parametrize("overrides, expected", [
    (["distillation.enabled=true"], "distillation.teacher.model_path: required with distillation.enabled=true"),
    (ON + ["distillation.kl_coef=0"], "distillation.kl_coef=0.0: must be > 0"),
    (ON + ["distillation.type=sglang"], "distillation.type=sglang needs distillation.teacher.url"),
    (SGLANG + ["distillation.teacher.gpus=2"], "distillation.teacher.gpus=2 places a Megatron teacher"),
    (SGLANG + ["distillation.teacher.request_timeout_s=0"], "distillation.teacher.request_timeout_s=0.0: must be > 0"),
    (ON + ["distillation.teacher.url=http://t:1"],
     "distillation.teacher.url='http://t:1' is for distillation.type=sglang"),
    (ON + ["distillation.teacher.api_key_env=TEACHER_KEY"],
     "distillation.teacher.api_key_env='TEACHER_KEY' is for distillation.type=sglang"),
    (SGLANG + ["distillation.teacher.api_key_env=MEGARL_TEST_UNSET_TEACHER_KEY"],
     "distillation.teacher.api_key_env=MEGARL_TEST_UNSET_TEACHER_KEY: that environment variable is not set"),
    (ON + ["distillation.use_task_rewards=false", "algorithm.adv_estimator=gae"],
     "distillation.use_task_rewards=false (pure OPD: the advantage is the teacher's signal alone) leaves nothing for "
     "algorithm.adv_estimator=gae's critic"),
    (ON + ["distillation.use_task_rewards=false", "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=true"],
     "algorithm.use_kl_in_reward=true would do nothing"),
    (ON + ["distillation.teacher.gpus=8"], "distillation.teacher.gpus=8: must be 0 (the training pool) or leave GPUs"),
    (ON + ["distillation.teacher.gpus=6", "placement.mode=split", "placement.rollout_gpus=2"],
     "distillation.teacher.gpus=6: must be 0 (the training pool) or leave GPUs for the other pools (1 .. 5 of the 8 "
     "GPUs, 2 of them for placement.rollout_gpus)"),
    (ON + ["distillation.teacher.megatron.tensor_model_parallel_size=3"],
     "distillation.teacher.megatron.tensor_model_parallel_size=3: a TP group must stay inside one node"),
    (ON + ["distillation.teacher.gpus=2", "distillation.teacher.megatron.tensor_model_parallel_size=4"],
     "distillation.teacher.megatron: TP x PP x CP = 4 x 1 x 1 = 4 GPUs per model replica does not divide the 2"),
    (ON + ["distillation.teacher.megatron.grad_offload=true"],
     "distillation.teacher.megatron.grad_offload: the teacher has no gradients or optimizer state"),
    (ON + ["distillation.teacher.gpus=2", "distillation.teacher.megatron.param_offload=true"],
     "distillation.teacher.megatron.param_offload=true: the teacher on its own pool shares no GPU"),
    (ON + ["placement.mode=split", "placement.rollout_gpus=2", "distillation.teacher.megatron.param_offload=true"],
     "the teacher on split placement's training pool shares no GPU"),
    (ON + ["distillation.loss_mode=k1", "distillation.use_policy_gradient=false"],
     "distillation.loss_mode=k1 with distillation.use_policy_gradient=false: the gradient of the k1 loss does not "
     "depend on the teacher"),
    (ON + ["distillation.loss_mode=forward_kl_topk", "distillation.use_policy_gradient=false", "distillation.topk=0"],
     "distillation.topk=0: must be >= 1"),
    (ON + ["distillation.loss_max_clamp=0"], "distillation.loss_max_clamp=0.0: must be > 0"),
    (ON + ["distillation.loss_mode=k4"], "distillation.loss_mode"),
])
def test_refused_naming_the_keys(overrides, expected):
    assert expected in fails(*overrides)


def test_the_teachers_key_comes_from_a_set_variable_and_never_sits_in_the_config(monkeypatch):
    monkeypatch.setenv("MEGARL_TEST_TEACHER_KEY", "s3cret")
    config = ok(*SGLANG, "distillation.teacher.api_key_env=MEGARL_TEST_TEACHER_KEY")
    assert config.distillation.teacher.api_key_env == "MEGARL_TEST_TEACHER_KEY"
    assert "s3cret" not in repr(config)
    monkeypatch.setenv("MEGARL_TEST_TEACHER_KEY", "")
    assert "MEGARL_TEST_TEACHER_KEY: that environment variable is not set (or empty)" in fails(
        *SGLANG, "distillation.teacher.api_key_env=MEGARL_TEST_TEACHER_KEY")


def test_forward_kl_topk_takes_either_teacher():
    for teacher in (ON, SGLANG):
        config = ok(*teacher, "distillation.loss_mode=forward_kl_topk", "distillation.use_policy_gradient=false")
        assert config.distillation.loss_mode == "forward_kl_topk"


def test_disabled_distillation_ignores_its_keys():
    ok("distillation.teacher.url=http://t:1", "distillation.teacher.gpus=99")


def test_pure_opd_with_one_response_per_prompt_is_allowed_without_the_group_warning(caplog):
    with caplog.at_level(logging.WARNING):
        ok(*ON, "distillation.use_task_rewards=false", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1",
           "actor_rollout_ref.actor.ppo_mini_batch_size=256")
    assert "every advantage will be 0" not in caplog.text
    with caplog.at_level(logging.WARNING):  # control: the same config as plain GRPO warns
        ok("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1")
    assert "every advantage will be 0" in caplog.text


def test_the_teacher_micro_batch_defaults_to_the_actors_and_the_old_log_probs_get_their_own_pass():
    config = ok(*ON, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4")
    assert config.distillation.teacher.log_prob_micro_batch_size_per_gpu == 4
    assert old_log_probs_in_update(config) is False  # the KL term needs them before the advantages
    assert old_log_probs_in_update(ok("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4")) is True


def test_a_teacher_pool_of_its_own_shrinks_the_others():
    shared = ok(*ON, "distillation.teacher.gpus=4")
    sizes = DerivedSizes.from_config(shared)
    assert (sizes.total_gpus, sizes.train_gpus, sizes.rollout_gpus, sizes.actor_dp) == (8, 4, 4, 4)
    split = ok(*ON, "distillation.teacher.gpus=2", "placement.mode=split", "placement.rollout_gpus=2")
    sizes = DerivedSizes.from_config(split)
    assert (sizes.train_gpus, sizes.rollout_gpus, sizes.actor_dp) == (4, 2, 4)


def test_the_planner_places_the_teacher_on_the_training_pool_or_its_own():
    plan = plan_from_config(ok(*ON, "distillation.teacher.megatron.tensor_model_parallel_size=2"))
    teacher = plan.roles["teacher"]
    assert (teacher.pool, teacher.tp, teacher.dp, teacher.world_size) == ("shared", 2, 4, 8)
    assert teacher.devices == plan.roles["actor"].devices
    own = plan_from_config(ok(*ON, "distillation.teacher.gpus=4",
                              "distillation.teacher.megatron.tensor_model_parallel_size=2"))
    teacher, actor = own.roles["teacher"], own.roles["actor"]
    assert (teacher.pool, teacher.dp, [d.gpu for d in teacher.devices]) == ("teacher", 2, [4, 5, 6, 7])
    assert [d.gpu for d in actor.devices] == list(range(4)) and not set(teacher.devices) & set(actor.devices)
    assert [d.gpu for d in own.roles["rollout"].devices] == list(range(4))
    assert "teacher" not in plan_from_config(ok(*SGLANG)).roles  # an SGLang teacher is not placed
    assert "teacher" not in plan_from_config(ok()).roles


VERL_OPD = ["distillation.enabled=true", "distillation.n_gpus_per_node=2", "distillation.nnodes=1",
            "distillation.teacher_models.teacher_model.model_path=/models/teacher",
            "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=2"]


def test_verls_distillation_loss_keys_mean_megarls_of_the_same_names():
    """verl's examples/on_policy_distillation_trainer/run_qwen3_8b_megatron.sh's loss keys."""
    d = ok(*VERL_OPD, "distillation.distillation_loss.loss_mode=forward_kl_topk",
           "distillation.distillation_loss.topk=64", "distillation.distillation_loss.use_task_rewards=False",
           "distillation.distillation_loss.use_policy_gradient=False",
           "distillation.distillation_loss.loss_max_clamp=10.0",
           "distillation.distillation_loss.log_prob_min_clamp=-10.0", "algorithm.adv_estimator=grpo").distillation
    assert (d.loss_mode, d.use_policy_gradient, d.topk, d.loss_max_clamp, d.log_prob_min_clamp, d.use_task_rewards) == (
        "forward_kl_topk", False, 64, 10.0, -10.0, False)


def test_verls_defaults_apply_where_its_script_leaves_the_loss(caplog):
    """verl's distillation.yaml: loss_mode k3, use_policy_gradient false (megarl's own defaults are k1 in
    the advantage); its coefficient counts with task rewards only (verl's distillation_ppo_loss)."""
    d = ok(*VERL_OPD, "distillation.distillation_loss.distillation_loss_coef=0.5").distillation
    assert (d.loss_mode, d.use_policy_gradient, d.kl_coef, d.loss_max_clamp, d.log_prob_min_clamp) == (
        "k3", False, 0.5, None, None)
    with caplog.at_level(logging.WARNING):
        d = ok(*VERL_OPD, "distillation.distillation_loss.distillation_loss_coef=0.5", "algorithm.adv_estimator=grpo",
               "distillation.distillation_loss.use_task_rewards=false").distillation
    assert d.kl_coef == 1.0 and "verl uses it with use_task_rewards=true only" in caplog.text
    d = ok(*VERL_OPD, "distillation.loss_mode=abs").distillation  # megarl's own key wins over verl's default
    assert (d.loss_mode, d.use_policy_gradient) == ("abs", False)
