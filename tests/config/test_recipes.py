"""The GPU recipes (configs/recipes/*.yaml) validate, and `megarl plan` places and fits each on its
stated cluster, with the model's architecture read from the HF config.json kept beside the recipes
(configs/recipes/models/<name>/config.json): no GPU and no downloaded weights needed.
Also: the tiny recipes (configs/tiny/*.yaml) validate and differ from tiny GRPO where they say."""
import re
from pathlib import Path

import pytest

from megarl.cli import main as megarl_main
from megarl.config import load_and_validate

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "configs/recipes"
MODELS = {"Qwen/Qwen2.5-7B-Instruct": RECIPES / "models/qwen2.5-7b-instruct",
          "Qwen/Qwen2.5-14B-Instruct": RECIPES / "models/qwen2.5-14b-instruct",
          "Qwen/Qwen2.5-32B-Instruct": RECIPES / "models/qwen2.5-32b-instruct",
          "Qwen/Qwen3-30B-A3B": RECIPES / "models/qwen3-30b-a3b",
          "Qwen/Qwen3-8B": RECIPES / "models/qwen3-8b",
          "Qwen/Qwen3-32B": RECIPES / "models/qwen3-32b",
          "unsloth/gpt-oss-20b-BF16": RECIPES / "models/gpt-oss-20b-bf16",
          "deepseek-ai/DeepSeek-V3": RECIPES / "models/deepseek-v3",
          "zai-org/GLM-4.5-Air": RECIPES / "models/glm-4.5-air"}
RECIPE_FILES = sorted(RECIPES.glob("*.yaml"))
EXPECTED = {"ppo", "grpo", "dr_grpo", "dapo", "rloo", "remax", "reinforce_pp", "reinforce_pp_baseline", "gspo",
            "dpo", "grpo_2node", "grpo_fp8",
            "grpo_lora_32b", "grpo_qwen3_30b_a3b", "opd_qwen3_8b_from_32b", "grpo_qwen3_8b_32k",
            "grpo_gpt_oss_20b", "grpo_deepseek_v3", "grpo_glm45_air"}


def test_every_algorithm_has_a_recipe():
    assert {p.stem for p in RECIPE_FILES} == EXPECTED


def model_dir(path: Path) -> Path:
    config = load_and_validate(path)
    assert config.actor_rollout_ref.model.path in MODELS, f"{path.name}: no architecture file for its model"
    return MODELS[config.actor_rollout_ref.model.path]


@pytest.mark.parametrize("path", RECIPE_FILES, ids=lambda p: p.stem)
def test_recipe_header_states_paper_and_launch(path):
    header = "".join(line for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))
    assert re.search(r"arXiv:\d{4}\.\d{4,5}", header), f"{path.name}: cite the paper (arXiv id)"
    trainer = "main_dpo" if path.stem == "dpo" else "main_ppo"
    assert f"python -m megarl.trainer.{trainer} --config configs/recipes/{path.name}" in header
    assert f"megarl plan {plan_args(path)}--config configs/recipes/{path.name}" in header


def plan_args(path: Path) -> str:
    return "--trainer dpo " if path.stem == "dpo" else ""


def model_overrides(path: Path) -> list[str]:
    """The recipe's models as their architecture files: the policy's, and a distillation teacher's."""
    config = load_and_validate(path)
    overrides = [f"actor_rollout_ref.model.path={model_dir(path)}"]
    if config.distillation.enabled:
        teacher = config.distillation.teacher.model_path
        assert teacher in MODELS, f"{path.name}: no architecture file for its teacher"
        overrides.append(f"distillation.teacher.model_path={MODELS[teacher]}")
    return overrides


@pytest.mark.parametrize("path", RECIPE_FILES, ids=lambda p: p.stem)
def test_recipe_plans_and_fits(path, capsys):
    """`megarl plan` exits 0 (fits) with a full memory estimate, and its GPU map puts a role on
    every GPU of the stated cluster."""
    config = load_and_validate(path)
    assert config.trainer.device != "cpu" and config.actor_rollout_ref.rollout.name == "sglang"
    assert config.placement.gpu_memory_gib == 80
    code = megarl_main(["plan", *plan_args(path).split(), "--config", str(path), *model_overrides(path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "memory estimate skipped" not in out
    peak, total = map(float, re.search(r"peak per GPU: ([\d.]+) GiB of ([\d.]+) GiB.*: fits", out).groups())
    assert peak <= total == 80.0
    t = config.trainer
    for node in range(t.nnodes):
        block = out.split(f"node{node}:\n")[1].split("\nnode")[0]
        gpus = re.findall(r"^  gpu(\d+): \[\w+\] \S", block, flags=re.MULTILINE)
        assert sorted(map(int, gpus)) == list(range(t.n_gpus_per_node)), f"{path.name}: node{node} map:\n{block}"
    assert "(unused)" not in out


@pytest.mark.parametrize("path", RECIPE_FILES, ids=lambda p: p.stem)
def test_each_recipe_finds_its_shipped_architecture_by_its_hub_id(path):
    from megarl.bridge.hub import shipped_architecture

    hub_id = load_and_validate(path).actor_rollout_ref.model.path
    assert shipped_architecture(hub_id, str(path)) == MODELS[hub_id]


def test_a_shipped_architecture_is_found_only_beside_the_experiment_file(tmp_path):
    from megarl.bridge.hub import shipped_architecture

    (tmp_path / "models/tiny-moe").mkdir(parents=True)
    (tmp_path / "models/tiny-moe/config.json").write_text("{}")
    (tmp_path / "models/no-config").mkdir()
    assert shipped_architecture("Org/Tiny-MoE", str(tmp_path / "exp.yaml")) == tmp_path / "models/tiny-moe"
    assert shipped_architecture("Org/No-Config", str(tmp_path / "exp.yaml")) is None
    assert shipped_architecture("Org/Tiny-MoE", None) is None  # overrides only: no experiment file
    assert shipped_architecture("Org/Tiny-MoE", str(tmp_path / "models/exp.yaml")) is None
    assert shipped_architecture("/abs/path", str(tmp_path / "exp.yaml")) is None  # not a hub id


def test_the_moe_recipe_plans_with_its_memory_estimate_without_the_hub(capsys, monkeypatch):
    """Issue 45: `megarl plan --config configs/recipes/grpo_qwen3_30b_a3b.yaml` alone, the hub out of
    reach (HF_HUB_OFFLINE=1): the estimate from configs/recipes/models/qwen3-30b-a3b (or the same
    architecture from the HF cache, where a machine has it): 63.2 of 80 GiB, and the EP 8 actor's layout."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = RECIPES / "grpo_qwen3_30b_a3b.yaml"
    assert megarl_main(["plan", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "memory estimate skipped" not in out
    assert "peak per GPU: 63.17 GiB of 80.00 GiB (placement.gpu_memory_gib): fits" in out
    assert "\nactor: TP 1 x CP 1 x PP 2 x DP 8 (experts: EP 8 x ETP 1 x expert-DP 1), " in out


def test_two_node_recipe_splits_rollout_onto_its_own_node(capsys):
    path = RECIPES / "grpo_2node.yaml"
    config = load_and_validate(path)
    assert (config.trainer.nnodes, config.trainer.n_gpus_per_node) == (2, 8)
    assert (config.placement.mode, config.placement.rollout_gpus) == ("split", 8)
    megarl_main(["plan", "--config", str(path), f"actor_rollout_ref.model.path={model_dir(path)}"])
    out = capsys.readouterr().out
    node0, node1 = out.split("node1:\n")
    assert "rollout" not in node0.split("node0:\n")[1] and "actor rank" not in node1.split("\nactor:")[0]
    assert "model: 14.770 B parameters" in out
    assert ("device cuda, training groups cpu:gloo,cuda:nccl, weight sync distributed over nccl, "
            "trainer env CUDA_DEVICE_MAX_CONNECTIONS=1 NCCL_CUMEM_ENABLE=0 NCCL_NVLS_ENABLE=0 "
            "TORCH_NCCL_ASYNC_ERROR_HANDLING=1 "
            "TORCH_NCCL_ENABLE_MONITORING=1 TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=1800\n") in out


def test_moe_recipe_spreads_the_experts_over_eight_ep_ranks_and_fits_only_with_offload(capsys):
    """Qwen3-30B-A3B on 2 x 8 GPUs: EP 8 (ETP 1) on TP 1 x PP 2, total and active parameters
    from its config.json (model card: 30.5 B, 3.3 B activated; tests/placement/test_moe_memory.py
    counts them by hand); the actor's training states must leave the GPUs while SGLang generates."""
    path = RECIPES / "grpo_qwen3_30b_a3b.yaml"
    config = load_and_validate(path)
    m = config.actor_rollout_ref.actor.megatron
    assert (m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.expert_model_parallel_size,
            m.expert_tensor_parallel_size) == (1, 2, 8, 1)
    assert (config.trainer.nnodes, config.trainer.n_gpus_per_node) == (2, 8)
    model = f"actor_rollout_ref.model.path={model_dir(path)}"
    assert megarl_main(["plan", "--config", str(path), model]) == 0
    out = capsys.readouterr().out
    assert "model: 30.532 B parameters (48 layers, hidden 2048), 3.353 B active (8 of 128 experts per token)" in out
    off = ["actor_rollout_ref.actor.megatron.param_offload=false", "actor_rollout_ref.actor.megatron.grad_offload=false",
           "actor_rollout_ref.actor.megatron.optimizer_offload=false"]
    assert megarl_main(["plan", "--config", str(path), model, *off]) != 0
    assert "DOES NOT FIT" in capsys.readouterr().out


def test_32k_recipe_fits_with_cp_sp_and_recompute_and_not_without(capsys):
    """Qwen3-8B, 2048 + 32768 tokens a sequence, on 2 x 8 GPUs: TP 2 (+SP) x CP 4 with full recompute
    fits; the same run at CP 1 without SP or recompute does not. Hand count of the latter's actor
    activations (Korthikanti et al. 2022 table 2, TP 2 without SP): 36 layers x 34816 x 4096 x
    (10 + 24 / 2) bytes, plus fp32 logits 34816 x 151936 / 2 x 4 bytes."""
    path = RECIPES / "grpo_qwen3_8b_32k.yaml"
    config = load_and_validate(path)
    m = config.actor_rollout_ref.actor.megatron
    assert (m.tensor_model_parallel_size, m.context_parallel_size, m.sequence_parallel) == (2, 4, True)
    assert config.data.max_prompt_length + config.data.max_response_length == 34816
    assert (config.trainer.nnodes, config.trainer.n_gpus_per_node) == (2, 8)
    model = f"actor_rollout_ref.model.path={model_dir(path)}"
    assert megarl_main(["plan", "--config", str(path), model]) == 0
    out = capsys.readouterr().out
    assert "\nactor: TP 2 x CP 4 x PP 1 x DP 2, " in out and "CP groups span nodes" not in out
    assert "(activations / CP 4, / TP 2 with sequence parallelism)  (full recompute: uniform" in out
    assert "Korthikanti et al. 2022" in out
    plain = ["actor_rollout_ref.actor.megatron.context_parallel_size=1", "actor_rollout_ref.actor.megatron.sequence_parallel=false",
             "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=null",
             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=34816",
             "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=34816"]
    assert megarl_main(["plan", "--config", str(path), model, *plain]) != 0
    out = capsys.readouterr().out
    activations = float(re.search(r"actor +states +[\d.]+ GiB +activations +([\d.]+) GiB", out).group(1))
    assert activations == pytest.approx((36 * 34816 * 4096 * 22 + 34816 * 151936 / 2 * 4) / 2**30, abs=0.01)
    assert "DOES NOT FIT" in out


def test_lora_recipe_fits_where_full_fine_tuning_of_the_same_32b_model_does_not(capsys):
    """`megarl plan` of the 32B LoRA recipe, and of the same recipe with LoRA off, side by side:
    the frozen base holds bf16 weights only, so the actor's states shrink from
    params/TP x (2 + 4 + 12) bytes to params/TP x 2 + adapters/GPU x 18 (hand-computed below)."""
    path = RECIPES / "grpo_lora_32b.yaml"
    model = f"actor_rollout_ref.model.path={MODELS['Qwen/Qwen2.5-32B-Instruct']}"
    peaks, actor_states = {}, {}
    for rank in (32, 0):
        code = megarl_main(["plan", "--config", str(path), model, f"actor_rollout_ref.model.lora.rank={rank}"])
        out = capsys.readouterr().out
        peaks[rank] = float(re.search(r"peak per GPU: ([\d.]+) GiB", out).group(1))
        actor_states[rank] = float(re.search(r"actor +states +([\d.]+) GiB", out).group(1))
        assert (code == 0) == (rank == 32), out
    assert peaks[32] <= 80 < peaks[0]
    # hand count: Qwen2.5-32B at TP 8; per layer A [32, in] whole on column-parallel targets, B / 8; the
    # row-parallel o/down split A / 8 with B whole
    h, f, q, kv, r, tp = 5120, 27648, 5120, 1024, 32, 8
    per_layer = (r * h * 5 + (q + 2 * kv + 2 * f) * r / tp) + (r * q / tp + h * r) + (r * f / tp + h * r)
    adapters = 64 * per_layer
    base = (64 * (h * q + 2 * h * kv + q * h + 3 * h * f + 2 * h) + 2 * 152064 * h + h) / tp
    assert actor_states[32] == pytest.approx(((base + adapters) * 2 + adapters * 16) / 2**30, abs=0.01)
    assert actor_states[0] == pytest.approx(base * 18 / 2**30, abs=0.01)


# Tiny recipes: what each changes relative to configs/tiny/grpo.yaml.
TINY = {
    "ppo": {"algorithm.adv_estimator": "gae", "critic.enable": True, "actor_rollout_ref.rollout.n": 1},
    "dr_grpo": {"algorithm.norm_adv_by_std_in_grpo": False,
                "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-sum-norm"},
    "dapo": {"algorithm.filter_groups.enable": True, "actor_rollout_ref.actor.clip_ratio_high": 0.28,
             "reward_model.overlong_buffer_len": 4},  # clip_ratio_low 0.2 and token-mean are GRPO's too
    "rloo": {"algorithm.adv_estimator": "rloo", "algorithm.use_kl_in_reward": True},
    "remax": {"algorithm.adv_estimator": "remax", "algorithm.use_kl_in_reward": True},
    "reinforce_pp": {"algorithm.adv_estimator": "reinforce_plus_plus", "algorithm.use_kl_in_reward": True},
    "reinforce_pp_baseline": {"algorithm.adv_estimator": "reinforce_plus_plus_baseline",
                              "algorithm.use_kl_in_reward": True},
    "grpo_lora": {"actor_rollout_ref.model.lora.rank": 8, "actor_rollout_ref.actor.optim.lr": 3e-3,
                  "actor_rollout_ref.model.lora.sync": "adapter", "actor_rollout_ref.rollout.check_weight_update": False},
    "grpo_fp8": {"actor_rollout_ref.rollout.quantization": "fp8", "actor_rollout_ref.rollout.dtype": "bfloat16",
                 "algorithm.rollout_correction.rollout_is": "token"},
    "opd": {"distillation.enabled": True, "distillation.use_task_rewards": False, "actor_rollout_ref.rollout.n": 1},
    "gspo": {"actor_rollout_ref.actor.policy_loss.loss_mode": "gspo", "actor_rollout_ref.actor.clip_ratio_low": 3e-4,
             "actor_rollout_ref.actor.clip_ratio_high": 4e-4,
             "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean"},
}


def _get(config, dotted: str):
    for part in dotted.split("."):
        config = getattr(config, part)
    return config


@pytest.mark.parametrize("name", sorted(TINY))
def test_tiny_recipe_is_grpo_but_for_its_algorithm(name):
    config = load_and_validate(REPO / f"configs/tiny/{name}.yaml")
    grpo = load_and_validate(REPO / "configs/tiny/grpo.yaml")
    for key, value in TINY[name].items():
        assert _get(config, key) == value, key
        assert _get(grpo, key) != value, f"{key} is already {value!r} in tiny GRPO"
    assert config.trainer.experiment_name == name
    assert (config.trainer.device, config.actor_rollout_ref.rollout.name) == ("cpu", "cpu")
    assert config.actor_rollout_ref.model.path == grpo.actor_rollout_ref.model.path


def test_dpo_plan_holds_the_policy_and_the_reference_and_no_rollout(capsys):
    path = RECIPES / "dpo.yaml"
    args = ["--config", str(path), f"actor_rollout_ref.model.path={model_dir(path)}"]
    megarl_main(["plan", "--trainer", "dpo", *args])
    dpo = capsys.readouterr().out
    assert "gpu0: [train] actor rank 0, ref rank 0" in dpo and "rollout" not in dpo
    assert re.search(r"^  ref +states", dpo, flags=re.MULTILINE)
    megarl_main(["plan", "--trainer", "sft", *args])
    sft = capsys.readouterr().out
    assert not re.search(r"\bref\b", sft) and "rollout" not in sft
    peak = lambda out: float(re.search(r"peak per GPU: ([\d.]+) GiB", out).group(1))  # noqa: E731
    assert peak(sft) < peak(dpo)  # the reference's weights and activations


def test_a_lora_critic_holds_optimizer_states_for_its_adapters_and_value_head_only(capsys):
    """`critic.model.lora` in `megarl plan`: the critic's frozen backbone holds bf16 weights only;
    fp32 gradients (4 bytes) and Adam states (12 bytes, the distributed optimizer's share of DP 8)
    are those of its adapters and its [1, H] value head."""
    path = RECIPES / "grpo_lora_32b.yaml"
    model = f"actor_rollout_ref.model.path={MODELS['Qwen/Qwen2.5-32B-Instruct']}"
    states = {}
    for rank in (32, 0):
        megarl_main(["plan", "--config", str(path), model, "algorithm.adv_estimator=gae", "critic.enable=true",
                     f"critic.model.lora.rank={rank}"])
        out = capsys.readouterr().out
        states[rank] = float(re.search(r"critic +states +([\d.]+) GiB", out).group(1)) * 2**30
    h, f, q, kv, r = 5120, 27648, 5120, 1024, 32  # Qwen2.5-32B; the critic at TP 1: every factor whole
    adapters = 64 * (r * h * 5 + (q + 2 * kv + 2 * f) * r + (r * q + h * r) + (r * f + h * r))
    base = states[0] / (2 + 4 + 12 / 8)  # full fine-tuning: bf16 weight, fp32 gradient, Adam over DP 8
    trainable = adapters + h
    assert states[32] == pytest.approx((base + adapters) * 2 + trainable * (4 + 12 / 8), abs=0.011 * 2**30)


# The small-machine layouts (issue 28; docs/benchmarks.md): the GRPO quickstart runs one training
# rank and one server per core of a 2-core machine (TP=1, DP=2, two colocated servers: 0.38 s/step
# against 0.43 with one rank and one server); the SFT stage and the tiny recipes, short runs and the
# tests' own, one logical GPU. The tests that cover TP=2, DP=2, two servers and split placement set
# those keys themselves.
CPU_CONFIGS = ["quickstart.yaml", "quickstart_sft.yaml", *sorted(f"tiny/{p.name}" for p in (REPO / "configs/tiny").glob("*.yaml"))]
LOGICAL_GPUS = {"quickstart.yaml": 2}  # the others: 1


@pytest.mark.parametrize("name", CPU_CONFIGS)
def test_cpu_configs_run_tp1_colocated_with_one_rank_and_one_server_per_logical_gpu(name):
    from megarl.config.validate import batch_plan

    gpus = LOGICAL_GPUS.get(name, 1)
    config = load_and_validate(REPO / "configs" / name)
    assert (config.trainer.nnodes, config.trainer.n_gpus_per_node, config.placement.mode) == (1, gpus, "colocate")
    roles = {"actor": config.actor_rollout_ref.actor.megatron, "ref": config.actor_rollout_ref.ref.megatron,
             "critic": config.critic.megatron, "reward_model": config.reward_model.megatron}
    for role, m in roles.items():
        assert (m.tensor_model_parallel_size, m.pipeline_model_parallel_size) == (1, 1), f"{name}: {role}"
    plan = batch_plan(config)
    assert (plan.rollout_servers, plan.actor_dp) == (gpus, gpus), name
    if name == "quickstart.yaml":  # one micro-batch per mini-batch and rank: 16 prompts x 8 / DP 2 = 64
        actor = config.actor_rollout_ref.actor
        assert actor.ppo_micro_batch_size_per_gpu == 16 * 8 // 2 == actor.ppo_mini_batch_size * 8 // gpus


def test_opd_recipe_places_and_counts_the_teacher(capsys):
    """The 32B teacher shares the 8 GPUs at TP 4 x DP 2 and is counted as a frozen model with its own
    architecture: bf16 weights of one TP-4 shard, offloaded while generating; the whole recipe is
    pure OPD, with the same tokenizer family (vocabulary) as the student."""
    path = RECIPES / "opd_qwen3_8b_from_32b.yaml"
    config = load_and_validate(path)
    assert config.distillation.enabled and not config.distillation.use_task_rewards
    assert megarl_main(["plan", "--config", str(path), *model_overrides(path)]) == 0
    out = capsys.readouterr().out
    assert "teacher: TP 4 x CP 1 x PP 1 x DP 2" in out
    assert "gpu7: [shared] actor rank 7, teacher rank 7, rollout server 3" in out
    # Qwen3-32B: 64 layers x (attention 5120 x (8192 + 2 x 1024) + 8192 x 5120 + 2 x 5120 norms + MLP 3 x 5120 x 25600)
    # + 2 x 151936 x 5120 embeddings + 5120 = 32.76 B parameters; over TP 4 in bf16: 15.26 GiB, all offloadable
    params = 64 * (5120 * (8192 + 2048) + 8192 * 5120 + 2 * 5120 + 3 * 5120 * 25600) + 2 * 151936 * 5120 + 5120
    (line,) = [line for line in out.splitlines() if line.startswith("  teacher ")]
    gib = f"{params / 4 * 2 / 2**30:.2f} GiB"
    assert line.startswith(f"  teacher       states    {gib}") and line.endswith(f"offloadable    {gib}")


def test_a_teacher_on_its_own_pool_is_a_phase_of_its_own_gpus():
    """`distillation.teacher.gpus=4`: the teacher's TP-4 replica sits on GPUs 4-7 alone; its weights
    and logits are the `teacher_pool` phase and no part of the training GPUs' phases."""
    from megarl.bridge import arch_from_hf_config, load_hf_config
    from megarl.placement import plan_from_config
    from megarl.placement.memory import estimate

    path = RECIPES / "opd_qwen3_8b_from_32b.yaml"
    config = load_and_validate(str(path), [*model_overrides(path), "distillation.teacher.gpus=4",
                                           "distillation.teacher.megatron.param_offload=false"])
    plan = plan_from_config(config)
    assert [d.gpu for d in plan.roles["teacher"].devices] == [4, 5, 6, 7]
    assert [d.gpu for d in plan.roles["actor"].devices] == [0, 1, 2, 3]
    arch = {m: arch_from_hf_config(load_hf_config(MODELS[m])) for m in ("Qwen/Qwen3-8B", "Qwen/Qwen3-32B")}
    est = estimate(plan, config, arch["Qwen/Qwen3-8B"], arch["Qwen/Qwen3-32B"])
    (teacher,) = [r for r in est.roles if r.role == "teacher"]
    others = [r for r in est.roles if r.role != "teacher"]
    assert est.phases["teacher_pool"] == teacher.states + teacher.activations
    assert est.phases["training"] == sum(r.states for r in others) + max(r.activations for r in others)
    assert est.peak == max(est.phases.values())
