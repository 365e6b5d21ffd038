"""Validation: impossible values, placement and the batch-size arithmetic in stated units."""
import logging

import pytest

from megarl.config import ConfigError, batch_plan, load_and_validate

from config_cases import fails, ok


def test_required_keys():
    with pytest.raises(ConfigError) as info:
        load_and_validate(None, [])
    msg = str(info.value)
    assert "actor_rollout_ref.model.path: required" in msg
    assert "data.train_files: required" in msg


def test_resolve_fills_derived_defaults():
    c = ok("actor_rollout_ref.actor.clip_ratio=0.3", "actor_rollout_ref.actor.clip_ratio_high=0.28",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "data.max_prompt_length=100")
    actor = c.actor_rollout_ref.actor
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (0.3, 0.28)
    assert c.actor_rollout_ref.rollout.prompt_length == 100
    assert c.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu == 4
    assert c.critic.enable is True  # default estimator is gae
    assert c.critic.model.path == "/models/m"
    assert ok("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2").critic.enable is False


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["data.train_batch_size=0"], "data.train_batch_size=0: must be a positive integer"),
        (["actor_rollout_ref.rollout.n=-1"], "actor_rollout_ref.rollout.n=-1: must be a positive integer"),
        (["trainer.save_freq=0"], "trainer.save_freq=0: must be a positive integer or -1 (never)"),
        (["algorithm.gamma=1.5"], "algorithm.gamma=1.5: must be in [0.0, 1.0]"),
        (["actor_rollout_ref.rollout.top_p=0"], "actor_rollout_ref.rollout.top_p=0.0: must be in (0.0, 1.0]"),
        (["actor_rollout_ref.rollout.temperature=-0.1"], "temperature=-0.1: must be >= 0"),
        (["actor_rollout_ref.rollout.top_k=0"], "top_k=0: must be a positive integer or -1"),
        (["actor_rollout_ref.actor.clip_ratio_c=0.5"], "dual-clip bound must be > 1"),
        (["trainer.logger=[console,tensorbord]"], "trainer.logger: unknown logger 'tensorbord'"),
        (["trainer.resume_mode=resume_path"], "needs trainer.resume_from_path"),
        (["algorithm.adv_estimator=gae", "critic.enable=false"], "algorithm.adv_estimator=gae needs a critic"),
        (["trainer.device=cpu", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
         "SGLang on a CPU serves one TP rank per server"),
        (["trainer.device=cpu", "actor_rollout_ref.actor.router_replay.mode=R3"],
         "router_replay.mode=R3 with rollout.name=sglang and trainer.device=cpu: SGLang 0.5.23 cannot return routed "
         "experts on a CPU"),
        (["trainer.device=cpu", "actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.sync=adapter"],
         "lora.sync=adapter with rollout.name=sglang and trainer.device=cpu: SGLang 0.5.23 cannot serve LoRA adapters"),
        (["reward_model.enable=true"], "reward_model.enable=true needs reward_model.model.path"),
        (["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=100"],
         "ppo_max_token_len_per_gpu=100 tokens is less than one full sequence"),
        (["data.gen_batch_size=0"], "data.gen_batch_size=0: must be a positive integer"),
        (["actor_rollout_ref.actor.tis_imp_ratio_cap=0.5"], "tis_imp_ratio_cap=0.5: must be -1 (off) or >= 1"),
        (["reward_model.enable=true", "reward_model.model.path=/rm", "reward_model.max_length=1000"],
         "reward_model.max_length=1000 tokens is less than a whole sequence (data.max_prompt_length + "
         "data.max_response_length = 1024 tokens)"),
        (["data.gen_batch_size=24"], "data.gen_batch_size=24 differs from data.train_batch_size=1024, which only DAPO"),
        (["actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2"],
         "needs actor_rollout_ref.actor.megatron.pipeline_model_parallel_size > 1"),
        (["actor_rollout_ref.rollout.check_weight_update=true"],
         "actor_rollout_ref.rollout.check_weight_update=true needs actor_rollout_ref.rollout.name=cpu (got 'sglang')"),
        (["actor_rollout_ref.rollout.batch_requests_per_server=true"],
         "batch_requests_per_server=true needs actor_rollout_ref.rollout.name=cpu (got 'sglang')"),
        (["actor_rollout_ref.rollout.batch_requests_per_server=true", "actor_rollout_ref.rollout.agent.path=/a.py"],
         "batch_requests_per_server=true with actor_rollout_ref.rollout.agent.path: agent turns are single requests"),
        (["actor_rollout_ref.rollout.batch_requests_per_server=true", "actor_rollout_ref.actor.router_replay.mode=R3"],
         "batch_requests_per_server=true with actor_rollout_ref.actor.router_replay.mode=R3: routing replay sends"),
    ],
)
def test_impossible_values(overrides, expected):
    assert expected in fails(*overrides)


def test_a_token_budget_per_gpu_holds_a_cp_ranks_share_of_a_sequence():
    """1024-token sequences: a budget of 600 per GPU holds no sequence at CP1, half of one (512) at CP2."""
    budget = ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=600"]
    assert "ppo_max_token_len_per_gpu=600 tokens is less than one full sequence" in fails(*budget)
    cp2 = ["actor_rollout_ref.actor.megatron.context_parallel_size=2", "trainer.n_gpus_per_node=2"]
    ok(*budget, *cp2)
    assert ("ppo_max_token_len_per_gpu=500 tokens is less than one full sequence (data.max_prompt_length + "
            "data.max_response_length = 1024 tokens, over actor_rollout_ref.actor.megatron.context_parallel_size=2 "
            "GPUs: 512 tokens each)") in fails(*budget[:1], "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=500", *cp2)


def test_grpo_with_one_response_warns_but_validates(caplog):
    with caplog.at_level(logging.WARNING, logger="megarl.config"):
        ok("algorithm.adv_estimator=grpo")
    assert "every advantage will be 0" in caplog.text


# ---------------------------------------------------------------- batch-size arithmetic
def test_batch_plan_good():
    c = ok("algorithm.adv_estimator=grpo", "data.train_batch_size=64", "actor_rollout_ref.rollout.n=8",
           "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
           "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "trainer.nnodes=2", "trainer.n_gpus_per_node=8")
    plan = batch_plan(c)
    assert plan.total_gpus == 16 and plan.train_gpus == 16
    assert plan.actor_dp == 8  # 16 GPUs / TP 2
    assert plan.responses_per_step == 512
    assert plan.actor_mini_batches_per_epoch == 4  # 64 / 16 prompts
    assert plan.actor_responses_per_mini_batch_per_rank == 16  # 16 x 8 / 8


def test_mini_batch_must_divide_train_batch():
    msg = fails("data.train_batch_size=10", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.n_gpus_per_node=1")
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=4 prompts must divide data.train_batch_size=10 prompts" in msg
    msg = fails("data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "trainer.n_gpus_per_node=1")
    assert "ppo_mini_batch_size=8 prompts is larger than data.train_batch_size=4 prompts" in msg


def test_responses_must_split_over_data_parallel_ranks():
    # 6 prompts x n=1 = 6 responses over DP 4: impossible; n=2 gives 12: fine for the step, but
    # the mini-batch of 3 prompts x 2 = 6 responses still does not split over 4 ranks.
    msg = fails("data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=3", "trainer.n_gpus_per_node=4")
    assert "data.train_batch_size=6 prompts x actor_rollout_ref.rollout.n=1 = 6 responses cannot be split evenly over the actor data-parallel size 4" in msg
    msg = fails("data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=3", "actor_rollout_ref.rollout.n=2",
                "trainer.n_gpus_per_node=4")
    assert "ppo_mini_batch_size=3 prompts x actor_rollout_ref.rollout.n=2 = 6 responses per mini-batch cannot be split evenly over the actor data-parallel size 4" in msg
    ok("data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=3", "actor_rollout_ref.rollout.n=4",
       "trainer.n_gpus_per_node=4")


def test_micro_batch_must_divide_per_rank_mini_batch():
    msg = fails("data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=3",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5", "trainer.n_gpus_per_node=2")
    assert "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5 responses must divide the 12 responses each actor data-parallel rank gets per mini-batch (8 prompts x 3 / DP 2)" in msg
    # dynamic batch sizes use token budgets instead of a count: no divisibility needed
    ok("data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=3",
       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5", "trainer.n_gpus_per_node=2",
       "actor_rollout_ref.actor.use_dynamic_bsz=true", "critic.use_dynamic_bsz=true")


def test_critic_batches_checked_only_when_critic_on():
    bad_critic = ["critic.ppo_micro_batch_size_per_gpu=5", "trainer.n_gpus_per_node=8"]
    assert "critic.ppo_micro_batch_size_per_gpu=5 responses must divide" in fails("algorithm.adv_estimator=gae", *bad_critic)
    ok("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", *bad_critic)


def test_parallel_sizes_against_gpus():
    msg = fails("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3")
    assert "tensor_model_parallel_size=3: a TP group must stay inside one node, so it must divide trainer.n_gpus_per_node=8 (try 2)" in msg
    msg = fails("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=3")
    assert "TP x PP x CP = 2 x 3 x 1 = 6 GPUs per model replica does not divide the 8 training GPUs" in msg
    msg = fails("actor_rollout_ref.rollout.tensor_model_parallel_size=3")
    assert "tensor_model_parallel_size=3: a rollout server within a node must divide trainer.n_gpus_per_node=8 (try 2)" in msg
    c = ok("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
           "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
           "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2", "trainer.nnodes=4")
    assert batch_plan(c).actor_dp == 8


def test_batched_requests_per_server_are_off_by_default_and_fit_the_cpu_engine():
    assert ok().actor_rollout_ref.rollout.batch_requests_per_server is False
    batched = ok("actor_rollout_ref.rollout.name=cpu", "trainer.device=cpu",
                 "actor_rollout_ref.rollout.batch_requests_per_server=true")
    assert batched.actor_rollout_ref.rollout.batch_requests_per_server is True


def test_verls_enable_prefix_caching_is_a_rollout_key_on_by_default():
    """verl's key; on by default as SGLang's radix cache (tests/rollout/test_sglang_flags.py checks
    the flag false becomes); a non-boolean value is refused naming the key."""
    assert ok().actor_rollout_ref.rollout.enable_prefix_caching is True
    assert ok("actor_rollout_ref.rollout.enable_prefix_caching=false").actor_rollout_ref.rollout.enable_prefix_caching is False
    assert "actor_rollout_ref.rollout.enable_prefix_caching" in fails("actor_rollout_ref.rollout.enable_prefix_caching=maybe")


def test_deterministic_inference_follows_exact_resume_unless_set():
    """SGLang reads sampling_params.sampling_seed only with --enable-deterministic-inference; the
    seeds are what make a resumed run exact."""
    det = lambda *o: ok(*o).actor_rollout_ref.rollout.deterministic_inference  # noqa: E731
    assert det("trainer.device=cuda") is True  # trainer.resume_mode=auto
    assert det("trainer.device=cuda", "trainer.resume_mode=disable") is False
    assert det("actor_rollout_ref.rollout.deterministic_inference=false") is False
    assert det("trainer.resume_mode=disable", "actor_rollout_ref.rollout.deterministic_inference=true") is True
    # SGLang on a CPU cannot: its deterministic mode takes GPU attention backends only
    # (srt/arg_groups/overrides.py::_deterministic_attention_backend); unset it is off there, set it is refused
    assert det("trainer.device=cpu") is False
    assert det("trainer.device=cpu", "actor_rollout_ref.rollout.name=cpu") is True  # the CPU engine's seeds hold
    assert "SGLang's deterministic inference needs a GPU attention backend" in fails(
        "trainer.device=cpu", "actor_rollout_ref.rollout.deterministic_inference=true")


def test_deterministic_inference_under_device_auto_is_decided_on_the_resolved_device():
    """trainer.device=auto resolves at launch: SGLang's command on a CPU must not carry
    --enable-deterministic-inference (0.5.23 refuses the CPU's torch-native attention backend in
    that mode, srt/arg_groups/overrides.py::_deterministic_attention_backend), on a GPU it must."""
    from megarl.rollout.launch import sglang_command

    config = ok("trainer.device=auto")
    assert config.actor_rollout_ref.rollout.deterministic_inference is None
    command = lambda device: sglang_command(config, "/m", 30000, device=device, colocated=False,  # noqa: E731
                                            context_length=64)
    assert "--enable-deterministic-inference" not in command("cpu")
    assert "--enable-deterministic-inference" in command("cuda")
    off = ok("trainer.device=auto", "trainer.resume_mode=disable")
    assert "--enable-deterministic-inference" not in sglang_command(off, "/m", 30000, device="cuda", colocated=False,
                                                                    context_length=64)


def test_a_rollout_server_may_span_whole_nodes_with_sglang_only():
    """SGLang runs one server over several nodes (--nnodes); megarl's CPU engine does not."""
    c = ok("actor_rollout_ref.rollout.tensor_model_parallel_size=16", "trainer.nnodes=4")
    assert batch_plan(c).rollout_servers == 2
    msg = fails("actor_rollout_ref.rollout.tensor_model_parallel_size=12", "trainer.nnodes=3")
    assert ("actor_rollout_ref.rollout.tensor_model_parallel_size=12: a rollout server larger than a node spans whole "
            "nodes, so it must be a multiple of trainer.n_gpus_per_node=8 (try 8)") in msg
    msg = fails("actor_rollout_ref.rollout.tensor_model_parallel_size=16", "trainer.nnodes=3")
    assert "tensor_model_parallel_size=16 GPUs per server must divide the 24 rollout GPUs" in msg
    msg = fails("actor_rollout_ref.rollout.name=cpu", "trainer.device=cpu", "trainer.n_gpus_per_node=2",
                "trainer.nnodes=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=4",
                "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8")
    assert ("actor_rollout_ref.rollout.tensor_model_parallel_size=4 is more than trainer.n_gpus_per_node=2: a server "
            "spanning nodes needs actor_rollout_ref.rollout.name=sglang") in msg
    ok("placement.mode=split", "placement.rollout_gpus=16", "trainer.nnodes=4",
       "actor_rollout_ref.rollout.tensor_model_parallel_size=16", "data.train_batch_size=64",
       "actor_rollout_ref.actor.ppo_mini_batch_size=16")


def test_split_placement():
    c = ok("placement.mode=split", "placement.rollout_gpus=4", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
           "trainer.n_gpus_per_node=8", "trainer.nnodes=2", "data.train_batch_size=96",
           "actor_rollout_ref.actor.ppo_mini_batch_size=24")
    plan = batch_plan(c)
    assert (plan.train_gpus, plan.rollout_gpus, plan.rollout_servers, plan.actor_dp) == (12, 4, 2, 12)
    assert "placement.rollout_gpus=0: with placement.mode=split it must leave GPUs for both pools (1 .. 7 of the 8 GPUs)" in fails("placement.mode=split")
    assert "placement.rollout_gpus=8" in fails("placement.mode=split", "placement.rollout_gpus=8")
    assert "placement.rollout_gpus=2 is used only with placement.mode=split" in fails("placement.rollout_gpus=2")
    # split leaves 5 training GPUs: the default mini-batch (256 prompts) cannot split over DP 5
    assert "actor data-parallel size 5" in fails("placement.mode=split", "placement.rollout_gpus=3")


def test_reference_follows_the_actor_layout_unless_set():
    c = ok("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2")
    assert c.actor_rollout_ref.ref.megatron.tensor_model_parallel_size == 2
    c = ok("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
           "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2")
    assert c.actor_rollout_ref.ref.megatron.tensor_model_parallel_size == 1
    assert c.actor_rollout_ref.ref.megatron.pipeline_model_parallel_size == 2


def test_a_warm_up_longer_than_the_run_is_refused_at_load_time():
    """The quickstart's 10 warm-up steps in a 1-step smoke run: before, the run started and its
    engine refused the schedule after the cluster was up."""
    msg = fails("trainer.total_training_steps=1", "actor_rollout_ref.actor.optim.lr_warmup_steps=10")
    assert ("actor_rollout_ref.actor.optim.lr_warmup_steps=10: the warm-up must end before the last of the 1 "
            "training steps") in msg
    msg = fails("trainer.total_training_steps=10", "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=1.0")
    assert "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=1.0 (10 steps)" in msg
    msg = fails("trainer.total_training_steps=20", "algorithm.adv_estimator=gae", "critic.optim.lr_warmup_steps=20")
    assert "critic.optim.lr_warmup_steps=20" in msg and "actor_rollout_ref" not in msg
    ok("trainer.total_training_steps=11", "actor_rollout_ref.actor.optim.lr_warmup_steps=10")
    ok("trainer.total_training_steps=null", "actor_rollout_ref.actor.optim.lr_warmup_steps=10")  # constant LR: no end
    ok("trainer.total_training_steps=20", "algorithm.adv_estimator=grpo", "critic.optim.lr_warmup_steps=20")  # no critic


def test_a_warm_up_longer_than_the_run_but_not_than_lr_decay_steps_is_accepted():
    """verl's fully async scripts set lr_decay_steps (total_rollout_steps) and a 10-step warm-up: megatron's
    scheduler asserts only lr_warmup_steps < lr_decay_steps (verl/utils/megatron/optimizer.py
    get_megatron_optimizer_param_scheduler passes both), so a shorter run is still in its warm-up."""
    warmup = "actor_rollout_ref.actor.optim.lr_warmup_steps=10"
    ok("trainer.total_training_steps=2", warmup, "actor_rollout_ref.actor.optim.lr_decay_steps=51200")
    msg = fails("trainer.total_training_steps=200", warmup, "actor_rollout_ref.actor.optim.lr_decay_steps=10")
    assert ("actor_rollout_ref.actor.optim.lr_warmup_steps=10: the warm-up must end before "
            "actor_rollout_ref.actor.optim.lr_decay_steps=10") in msg
    # a ratio is of lr_decay_steps, as verl reads it: 1.0 x 8 steps, not x 100
    msg = fails("trainer.total_training_steps=100", "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=1.0",
                "actor_rollout_ref.actor.optim.lr_decay_steps=8", "actor_rollout_ref.actor.optim.warmup_style=cosine")
    assert "lr_warmup_steps_ratio=1.0 (8 steps): the warm-up must end before" in msg
    # a decaying schedule over lr_decay_steps needs no step count
    ok("trainer.total_training_steps=null", "actor_rollout_ref.actor.optim.warmup_style=cosine",
       "actor_rollout_ref.actor.optim.lr_decay_steps=100")


def test_verls_absolute_min_lr_is_the_decays_floor_set_once_and_within_lr():
    c = ok("actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.optim.min_lr=1e-7")
    assert c.actor_rollout_ref.actor.optim.final_lr() == 1e-7
    assert ok("actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.optim.min_lr_ratio=0.5"
              ).actor_rollout_ref.actor.optim.final_lr() == 5e-7
    msg = fails("actor_rollout_ref.actor.optim.min_lr=1e-7", "actor_rollout_ref.actor.optim.min_lr_ratio=0.1")
    assert ("actor_rollout_ref.actor.optim.min_lr=1e-07 and actor_rollout_ref.actor.optim.min_lr_ratio=0.1 both set "
            "where the learning rate decays to: set one") in msg
    msg = fails("actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.optim.min_lr=1e-5")
    assert "the learning rate decays to 1e-05 (min_lr, or lr x min_lr_ratio), which must lie in [0, lr=1e-06]" in msg


def test_the_lr_schedule_takes_the_trainers_step_count_or_asks_for_one():
    c = ok("trainer.total_training_steps=200", "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1")
    assert c.actor_rollout_ref.actor.optim.total_training_steps == 200
    assert c.critic.optim.total_training_steps == 200
    assert ok("trainer.total_training_steps=200", "actor_rollout_ref.actor.optim.total_training_steps=50"
              ).actor_rollout_ref.actor.optim.total_training_steps == 50
    msg = fails("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1")
    assert "actor_rollout_ref.actor.optim: lr_warmup_steps_ratio" in msg and "set trainer.total_training_steps" in msg


def test_gen_batch_size_with_dynamic_sampling_or_equal_to_the_train_batch():
    dapo = ("algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "algorithm.filter_groups.enable=true")
    assert ok(*dapo, "data.gen_batch_size=3072").data.prompts_per_generation == 3072
    assert ok("data.gen_batch_size=1024").data.prompts_per_generation == 1024
    assert ok().data.prompts_per_generation == 1024


def test_sglang_on_a_cpu_takes_merged_lora_and_the_cpu_engine_takes_replay_and_adapters():
    """What SGLang on a CPU cannot start with (routing replay, LoRA adapters) megarl's CPU engine serves;
    merged LoRA sends SGLang plain weights."""
    ok("trainer.device=cpu", "actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.sync=merged")
    ok("trainer.device=cpu", "actor_rollout_ref.rollout.name=cpu", "actor_rollout_ref.actor.router_replay.mode=R3",
       "actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.sync=adapter")
