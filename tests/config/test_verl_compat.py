"""verl's command line as verl users write it: the keys megarl accepts (one warning each), Hydra's
--config-path/--config-name, and a verl Megatron example script unchanged but for the module name."""
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.config import ConfigError, load_and_validate, load_config
from megarl.config.verl_compat import DAPO_DEFAULTS, DAPO_MODULE, FULLY_ASYNC_DEFAULTS, ONE_STEP_OFF_DEFAULTS, VERL_KEYS

HERE = Path(__file__).resolve().parent
BASE = ["actor_rollout_ref.model.path=/m", "data.train_files=/d.parquet", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "trainer.n_gpus_per_node=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]
# verl keys that appear in nearly every verl script (issue 26 item 2); each was "unknown key" before
VERL_SCRIPT_KEYS = ["actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.rollout.mode=async",
                    "actor_rollout_ref.rollout.enable_chunked_prefill=True",
                    "actor_rollout_ref.rollout.load_format=dummy_megatron",
                    "actor_rollout_ref.actor.megatron.use_mbridge=True",
                    "actor_rollout_ref.actor.fsdp_config.param_offload=False"]


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "megarl.config" and r.levelno == logging.WARNING]


def test_verl_keys_are_accepted_with_one_warning_line_each(caplog):
    with caplog.at_level(logging.WARNING, logger="megarl.config"):
        config = load_and_validate(None, BASE + VERL_SCRIPT_KEYS)
    lines = _warnings(caplog)
    for text in VERL_SCRIPT_KEYS:
        key = text.split("=")[0]
        mine = [line for line in lines if line.startswith(key + " (verl key")]
        assert len(mine) == 1, (key, lines)
        assert "ignored" in mine[0]
    assert config.actor_rollout_ref.model.path == "/m"


def test_verls_rollout_correction_lines_validate_as_verls_guide_writes_them(caplog):
    """docs/algo/rollout_corr.md of verl 0.9.1: the correction keys plus calculate_log_probs=true."""
    rc = "algorithm.rollout_correction"
    with caplog.at_level(logging.WARNING, logger="megarl.config"):
        config = load_and_validate(None, BASE + [
            f"{rc}.rollout_is=token", f"{rc}.rollout_is_threshold=2.0", f"{rc}.rollout_rs=seq_mean_k1",
            f"{rc}.rollout_rs_threshold=0.999_1.001", "actor_rollout_ref.rollout.calculate_log_probs=true"])
    assert config.algorithm.rollout_correction.rollout_rs_threshold == "0.999_1.001"
    assert [line for line in _warnings(caplog) if line.startswith("actor_rollout_ref.rollout.calculate_log_probs")]


def test_a_mapped_key_and_a_mapped_value_reach_megarl_keys(caplog):
    with caplog.at_level(logging.WARNING, logger="megarl.config"):
        config = load_config(None, BASE + ["actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",
                                           "actor_rollout_ref.rollout.name=vllm"])
    assert config.actor_rollout_ref.actor.optim.warmup_style == "cosine"
    assert config.actor_rollout_ref.rollout.name == "sglang"
    lines = _warnings(caplog)
    assert any("goes to actor_rollout_ref.actor.optim.warmup_style" in line for line in lines), lines
    assert any(line.startswith("actor_rollout_ref.rollout.name=vllm") and "using sglang" in line for line in lines)


def test_verl_keys_in_a_yaml_file_are_accepted_too(tmp_path, caplog):
    (tmp_path / "exp.yaml").write_text(
        "actor_rollout_ref:\n  model:\n    use_remove_padding: true\n  actor:\n    fsdp_config:\n"
        "      param_offload: false\n      wrap_policy: {min_num_params: 0}\n")
    with caplog.at_level(logging.WARNING, logger="megarl.config"):
        load_config(tmp_path / "exp.yaml", BASE)
    lines = _warnings(caplog)
    assert sum("use_remove_padding (verl key" in line for line in lines) == 1
    assert sum("fsdp_config" in line for line in lines) == 1, lines  # the group, once


def test_other_unknown_keys_are_still_errors():
    with pytest.raises(ConfigError, match="actor_rollout_ref.model.use_remove_paddin'"):
        load_config(None, BASE + ["actor_rollout_ref.model.use_remove_paddin=True"])
    # a top-level verl key (a Hydra defaults group such as model_engine) is accepted for one value only
    assert all(key.count(".") >= 1 or entry.only is not None for key, entry in VERL_KEYS.items())


def _megarl_python_as_python3(tmp_path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # keeps the venv's sys.prefix
    (bin_dir / "python3").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path),
            "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}


def test_verl_megatron_example_script_validates(tmp_path):
    """verl's run_qwen2-7b_math_megatron.sh, unchanged but for the module name: the config validates;
    what stops its dry run here is only this machine (no data, the model not in the HF cache, no GPU)."""
    r = subprocess.run(["bash", str(HERE / "verl/run_qwen2-7b_math_megatron.sh"), "--dry-run"], cwd=tmp_path,
                       env=_megarl_python_as_python3(tmp_path), capture_output=True, text=True, timeout=120)
    assert "config OK" in r.stdout, r.stderr
    assert "invalid config" not in r.stderr and "unrecognized arguments" not in r.stderr, r.stderr
    assert "1024 prompts x n=5 = 5120 responses" in r.stdout
    assert "actor_rollout_ref.rollout.mode (verl key" in r.stderr
    assert "--config-name=ppo_megatron_trainer.yaml: verl's packaged base config" in r.stderr
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"data.train_files: file not found: {tmp_path}/data/gsm8k/train.parquet" in r.stderr
    assert "'Qwen/Qwen2-7B-Instruct': HF_HUB_OFFLINE=1 and it is not in the HF cache" in r.stderr


def test_config_path_and_name_read_a_local_file(tmp_path):
    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "mine.yaml").write_text("trainer:\n  experiment_name: from-hydra-style\n")
    r = subprocess.run([sys.executable, "-m", "megarl.cli", "config", "show", "--config-path", "conf",
                        "--config-name=mine", *BASE], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "experiment_name: from-hydra-style" in r.stdout
    r = subprocess.run([sys.executable, "-m", "megarl.cli", "config", "show", "--config-name=absent", *BASE],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "config file not found: absent.yaml" in r.stderr


def test_forgetting_config_gives_a_hint():
    with pytest.raises(ConfigError, match="a YAML experiment file goes after --config"):
        load_config(None, ["configs/quickstart.yaml"])


def _run_verl_script(name: str, tmp_path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(HERE / "verl" / name), "--dry-run"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)


def test_verl_qwen3_moe_sglang_megatron_script_loads_every_override(tmp_path):
    """verl's run_qwen3_30b_a3b_sglang_megatron.sh (54 overrides; 7 were refused: model_engine, the four
    override_transformer_config keys, rollout.log_prob_use_dynamic_bsz / log_prob_max_token_len_per_gpu):
    no key is refused. At its defaults (1 node x 8 GPUs) the layout is, as megatron-core's
    initialize_model_parallel refuses it (parallel_state.py: world size % (ETP x EP x PP)); on 4 nodes it
    validates and the dry run stops only at this machine."""
    script, env = "run_qwen3_30b_a3b_sglang_megatron.sh", _megarl_python_as_python3(tmp_path)
    r = _run_verl_script(script, tmp_path, env)
    problems = [line for line in r.stderr.splitlines() if line.startswith("  - ")]
    assert problems == [f"  - actor_rollout_ref.{role}.megatron: ETP x EP x PP = 4 x 4 x 2 does not divide the 8 "
                        "training GPUs (megatron places the experts of each pipeline stage over ETP x EP ranks)"
                        for role in ("actor", "ref")], r.stderr
    r = _run_verl_script(script, tmp_path, {**env, "NNODES": "4"})
    assert "config OK" in r.stdout, r.stderr
    assert "actor: TP 4 x PP 2 x DP 4, EP 4\n" in r.stdout  # issue 45: the layout line shows EP
    assert "invalid config" not in r.stderr and "Traceback" not in r.stderr and r.returncode == 2
    assert f"data.train_files: file not found: {tmp_path}/data/dapo-math-17k.parquet" in r.stderr
    for key in ("model_engine", "actor_rollout_ref.actor.megatron.override_transformer_config.use_flash_attn"):
        assert f"megarl: WARNING: {key} (verl key" in r.stderr


# ---------------------------------------------------------------------------------------------
# issue 52: verl's newer keys, its fully async / one-step-off keys and entry points
# ---------------------------------------------------------------------------------------------
def test_ray_kwargs_py_executable_is_accepted_with_one_warning_and_env_vars_reach_worker_env(caplog):
    key = "ray_kwargs.ray_init.runtime_env.py_executable"
    with caplog.at_level(logging.WARNING, logger="megarl.config"):
        config = load_and_validate(None, BASE + [f"{key}=uv -v run --frozen",
                                                 "+ray_kwargs.ray_init.runtime_env.env_vars.X=0"])
    assert len([line for line in _warnings(caplog) if line.startswith(key + " (verl key")]) == 1
    assert config.trainer.worker_env == {"X": "0"}  # Ray takes strings only (runtime_env env_vars)


def test_ray_kwargs_in_yaml_keeps_its_env_vars_and_drops_the_rest(tmp_path, caplog):
    """A YAML `ray_kwargs:` group is walked key by key: its env_vars reach trainer.worker_env, its other
    keys (ray.init's arguments, py_executable) are dropped with one warning each."""
    experiment = tmp_path / "exp.yaml"
    experiment.write_text("ray_kwargs:\n  ray_init:\n    num_cpus: 4\n    runtime_env:\n"
                          "      py_executable: uv run\n      env_vars:\n        NCCL_DEBUG: INFO\n        FLAG: 1\n")
    with caplog.at_level(logging.WARNING, logger="megarl.config"):
        config = load_config(experiment, BASE)
    assert config.trainer.worker_env == {"NCCL_DEBUG": "INFO", "FLAG": "1"}
    warned = [line.split(" (")[0] for line in _warnings(caplog) if "(verl key" in line]
    assert sorted(warned) == ["ray_kwargs.ray_init.num_cpus", "ray_kwargs.ray_init.runtime_env.env_vars.FLAG",
                              "ray_kwargs.ray_init.runtime_env.env_vars.NCCL_DEBUG",
                              "ray_kwargs.ray_init.runtime_env.py_executable"]


def test_a_worker_env_value_ray_cannot_take_is_refused_naming_it():
    with pytest.raises(ConfigError, match=r"trainer\.worker_env: FLAG: True is not a string"):
        load_config(None, BASE + ["+trainer.worker_env.FLAG=true"])


@pytest.mark.parametrize("prefix", ["+reward.reward_kwargs", "+reward_model.reward_kwargs"])
def test_dapo_overlong_kwargs_reach_megarls_overlong_keys(prefix):
    """verl-recipe's dapo/test_dapo_7b_math_megatron.sh writes +reward_model.reward_kwargs.*, verl's newer
    scripts +reward.reward_kwargs.* with reward.reward_manager.name: megarl's reward_model keys take them."""
    config = load_and_validate(None, BASE + [
        "reward.reward_manager.name=dapo", "data.max_response_length=2048",
        f"{prefix}.overlong_buffer_cfg.enable=True", f"{prefix}.overlong_buffer_cfg.len=512",
        f"{prefix}.overlong_buffer_cfg.penalty_factor=0.5", f"{prefix}.overlong_buffer_cfg.log=False",
        f"{prefix}.max_resp_len=2048"])
    rm = config.reward_model
    assert (rm.reward_manager, rm.overlong_buffer_len, rm.overlong_penalty_factor) == ("dapo", 512, 0.5)
    off = load_and_validate(None, BASE + [f"{prefix}.overlong_buffer_cfg.enable=False",
                                          f"{prefix}.overlong_buffer_cfg.len=512"])
    assert off.reward_model.overlong_buffer_len == 0
    with pytest.raises(ConfigError, match="max_resp_len=4096: megarl's overlong penalty counts from"):
        load_config(None, BASE + [f"{prefix}.overlong_buffer_cfg.enable=True", f"{prefix}.overlong_buffer_cfg.len=8",
                                  f"{prefix}.max_resp_len=4096"])


ASYNC = ["rollout.nnodes=1", "rollout.n_gpus_per_node=8", "async_training.staleness_threshold=0.5",
         "async_training.trigger_parameter_sync_step=4", "async_training.require_batches=2",
         "rollout.total_rollout_steps=204800", "data.train_batch_size=0", "actor_rollout_ref.hybrid_engine=False",
         "data.gen_batch_size=1"]
VERL_GPUS = ["actor_rollout_ref.model.path=/m", "data.train_files=/d.parquet", "actor_rollout_ref.actor.ppo_mini_batch_size=32",
             "trainer.nnodes=2", "trainer.n_gpus_per_node=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]


def test_fully_async_keys_on_main_ppo_are_refused_rather_than_run_synchronously():
    with pytest.raises(ConfigError, match="megarl.experimental.fully_async_policy.fully_async_main"):
        load_config(None, VERL_GPUS + ASYNC)


def test_fully_async_keys_with_the_fully_async_entry_points_defaults():
    """verl's grpo_*_fully-async scripts: a trainer step of require_batches x ppo_mini_batch_size prompts
    and a sync every trigger_parameter_sync_step steps is megarl's step of 2 x 4 x 32 = 256 prompts;
    204800 prompts are 800 steps; the rollout's node joins the two training nodes."""
    config = load_and_validate(None, [*FULLY_ASYNC_DEFAULTS, *VERL_GPUS, *ASYNC])
    assert config.async_training.mode == "fully_async" and config.async_training.partial_rollout
    assert config.data.train_batch_size == 256 and config.data.gen_batch_size is None
    assert config.async_training.max_staleness == 1  # ceil(0.5)
    assert config.trainer.total_training_steps == 800
    assert (config.placement.mode, config.placement.rollout_gpus, config.trainer.nnodes) == ("split", 8, 3)
    assert config.algorithm.rollout_correction.bypass_mode  # verl's fully async yaml: the rollout's log-probs are the old ones


def test_one_step_off_pools_on_one_node_share_it():
    """verl's dapo_7b_math_megatron_4_12.sh shape: 6 training + 2 rollout GPUs on one 8-GPU node."""
    config = load_and_validate(None, [*ONE_STEP_OFF_DEFAULTS, "actor_rollout_ref.model.path=/m",
                                      "data.train_files=/d.parquet", "data.train_batch_size=12",
                                      "actor_rollout_ref.actor.ppo_mini_batch_size=6", "trainer.nnodes=1",
                                      "trainer.n_gpus_per_node=6", "rollout.nnodes=1", "rollout.n_gpus_per_node=2"])
    assert (config.trainer.n_gpus_per_node, config.placement.rollout_gpus) == (8, 2)
    assert config.async_training.mode == "one_step_off"


def test_moe_overrides_go_to_megarls_keys_at_their_defaults_and_show_once():
    otc = "actor_rollout_ref.actor.megatron.override_transformer_config"
    config = load_and_validate(None, BASE + [f"+{otc}.moe_grouped_gemm=True", f"+{otc}.moe_aux_loss_coeff=0.01",
                                             f"+{otc}.moe_z_loss_coeff=0.001"])
    m = config.actor_rollout_ref.actor.megatron
    assert (m.moe_grouped_gemm, m.moe_aux_loss_coeff, m.moe_z_loss_coeff) == (True, 0.01, 0.001)
    assert m.override_transformer_config == {}
    with pytest.raises(ConfigError, match="moe_aux_loss_coeff=0.01 conflicts with"):
        load_and_validate(None, BASE + ["actor_rollout_ref.actor.megatron.moe_aux_loss_coeff=0.02",
                                        f"+{otc}.moe_aux_loss_coeff=0.01"])
    # verl's Ascend scripts' sequence_parallel=True (megarl's key at its default, false): megarl's key takes it
    tp2 = ["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=2"]
    config = load_and_validate(None, BASE + tp2 + [f"+{otc}.sequence_parallel=True"])
    assert config.actor_rollout_ref.actor.megatron.sequence_parallel is True
    assert "sequence_parallel" not in config.actor_rollout_ref.actor.megatron.override_transformer_config


def test_hydra_double_plus_and_verls_default_transformer_keys_without_plus():
    otc = "actor_rollout_ref.actor.megatron.override_transformer_config"
    config = load_config(None, BASE + [f"++{otc}.attention_backend=auto", f"{otc}.recompute_granularity=full",
                                       "++trainer.nnodes=1"])
    assert config.actor_rollout_ref.actor.megatron.override_transformer_config == {
        "attention_backend": "auto", "recompute_granularity": "full"}
    with pytest.raises(ConfigError, match="add it with"):  # not a key of verl's default: '+' as Hydra wants
        load_config(None, BASE + [f"{otc}.moe_router_dtype=fp32"])
    with pytest.raises(ConfigError, match="Could not append to config"):
        load_config(None, BASE + ["+algorithm.filter_groups.enable=True"])


def test_optimizer_overrides_reach_megatrons_optimizer_config_and_conflicts_are_refused():
    import torch

    from megarl.config.schema import OptimConfig
    from megarl.engines.megatron.optim import optimizer_config_fields, optimizer_kwargs

    fields = optimizer_config_fields()
    optim = OptimConfig(lr=1e-6, override_optimizer_config={
        "optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5, "use_precision_aware_optimizer": True,
        "overlap_cpu_optimizer_d2h_h2d": True, "lr": 1e-6})
    kwargs = optimizer_kwargs(optim, torch.bfloat16, True, False, fields, "actor_rollout_ref.actor")
    assert (kwargs["optimizer_cpu_offload"], kwargs["optimizer_offload_fraction"], kwargs["bf16"]) == (True, 0.5, True)
    bad = OptimConfig(lr=1e-6, override_optimizer_config={"offload_fraction": 1.0, "lr": 1e-5})
    with pytest.raises(ValueError) as info:
        optimizer_kwargs(bad, torch.bfloat16, True, False, fields, "actor_rollout_ref.actor")
    assert "override_optimizer_config.offload_fraction: not a field of megatron-core's OptimizerConfig" in str(info.value)
    assert "override_optimizer_config.lr=1e-05 conflicts with optim.lr" in str(info.value)


def test_fully_async_module_runs_the_fully_async_mode(tmp_path):
    """The renamed module: its dry run describes split placement (the rollout's own GPUs), not the synchronous
    colocated trainer that main_ppo with the same keys would have been."""
    r = subprocess.run([sys.executable, "-m", "megarl.experimental.fully_async_policy.fully_async_main", "--dry-run",
                        "--config-path=config", "--config-name=fully_async_ppo_megatron_trainer.yaml",
                        *VERL_GPUS, *ASYNC], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert "config OK" in r.stdout, r.stderr
    assert "3 node(s) x 8 = 24 (split: 16 training, 8 rollout" in r.stdout
    assert "step: 256 prompts" in r.stdout
    assert "mode: fully_async, samples at most 1 weight version(s) old, partial rollouts" in r.stdout


def test_use_dist_checkpointing_needs_its_path_and_is_the_actor_and_references_only():
    """verl's use_dist_checkpointing: megarl's own keys for the actor and the reference (the engine test
    tests/engines/test_megatron_engine.py scores a bare torch_dist directory loaded this way)."""
    config = load_and_validate(None, BASE + ["actor_rollout_ref.actor.megatron.use_dist_checkpointing=true",
                                             "actor_rollout_ref.actor.megatron.dist_checkpointing_path=/ckpt/mcore"])
    assert config.actor_rollout_ref.actor.megatron.dist_checkpointing_path == "/ckpt/mcore"
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.ref\.megatron\.use_dist_checkpointing=true needs "
                                          r"actor_rollout_ref\.ref\.megatron\.dist_checkpointing_path"):
        load_and_validate(None, BASE + ["actor_rollout_ref.ref.megatron.use_dist_checkpointing=true"])
    with pytest.raises(ConfigError, match=r"critic\.megatron\.use_dist_checkpointing=true: megarl builds the critic "
                                          r"from its HF checkpoint"):
        load_and_validate(None, BASE + ["critic.megatron.use_dist_checkpointing=true",
                                        "critic.megatron.dist_checkpointing_path=/ckpt/mcore"])


def test_dapo_recipe_module_runs_megarls_loop_with_the_recipes_defaults(tmp_path):
    """verl-recipe's recipe.dapo.main_dapo renamed: its dapo_trainer.yaml's defaults (verl-recipe 2026-08-05:
    reward.reward_manager.name dapo, trainer.project_name verl-dapo) under the script's keys, DAPO's dynamic
    sampling and overlong shaping in megarl's keys; the dry run names the recipe's project."""
    overrides = ["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
                 "algorithm.filter_groups.max_num_gen_batches=10", "actor_rollout_ref.rollout.n=16",
                 "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=true",
                 "+reward_model.reward_kwargs.overlong_buffer_cfg.len=512",
                 "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0"]
    config = load_and_validate(None, [*DAPO_DEFAULTS, *BASE, *overrides])
    assert (config.reward_model.reward_manager, config.trainer.project_name) == ("dapo", "verl-dapo")
    assert (config.algorithm.filter_groups.metric, config.algorithm.filter_groups.max_num_gen_batches) == ("acc", 10)
    assert (config.reward_model.overlong_buffer_len, config.reward_model.overlong_penalty_factor) == (512, 1.0)
    r = subprocess.run([sys.executable, "-m", DAPO_MODULE, "--dry-run", *BASE, *overrides], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert "config OK" in r.stdout, r.stderr
    assert r.stdout.startswith("experiment verl-dapo/")
