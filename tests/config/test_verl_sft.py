"""verl's SFT trainer keys (megarl.config.verl_sft) as `python -m megarl.trainer.sft_trainer` loads
them: each lands on the megarl key that does what verl's does (verl/trainer/config/sft_trainer_engine.yaml,
engine/megatron.yaml, optim/megatron.yaml, model/hf_model.yaml), a key without meaning here warns
once, one megarl cannot honour is refused naming the override."""
import json
import logging
from pathlib import Path

import pytest

from megarl.config import ConfigError, load_and_validate, load_config
from megarl.config.verl_compat import SFT_DEFAULTS

NEMOTRON = "examples/sft/gsm8k/run_nemotron_nano_v3_megatron.sh"


def script(path: str) -> list[str]:
    corpus = json.loads((Path(__file__).resolve().parent / "verl" / "corpus.json").read_text())
    (entry,) = [s for s in corpus["scripts"] if s["path"] == path]
    return entry["args"]


def sft(*overrides: str, validate: bool = False):
    if validate:
        return load_and_validate(None, [*SFT_DEFAULTS, *overrides], verl_sft=True, steps_from_data=True)
    return load_config(None, [*SFT_DEFAULTS, *overrides], verl_sft=True)


def test_nemotron_sft_script_means_the_same_in_megarl(caplog):
    args = script(NEMOTRON)
    with caplog.at_level(logging.WARNING, "megarl.config"):
        c = sft(*args, validate=True)
    arr, d, t = c.actor_rollout_ref, c.data, c.trainer
    actor, mcore, optim = arr.actor, arr.actor.megatron, arr.actor.optim
    assert (arr.model.path, arr.model.trust_remote_code, arr.model.dtype) == (
        "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", True, "bfloat16")
    assert (d.messages_key, d.max_length, d.truncation, d.ignore_input_ids_mismatch) == (
        "messages", 2048, "error", True)
    # one optimizer step per batch of 96 chats, micro-batches of at most 2048 tokens
    assert (d.train_batch_size, actor.ppo_mini_batch_size) == (96, 96)
    assert (actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu) == (True, 2048)
    assert (mcore.tensor_model_parallel_size, mcore.pipeline_model_parallel_size, mcore.context_parallel_size,
            mcore.expert_model_parallel_size, mcore.expert_tensor_parallel_size,
            mcore.virtual_pipeline_model_parallel_size) == (8, 1, 1, 8, 1, None)
    assert mcore.override_transformer_config == {"attention_backend": "auto", "recompute_method": "uniform",
                                                 "recompute_granularity": "full", "recompute_num_layers": 1}
    assert (optim.lr, optim.min_lr, optim.lr_warmup_steps, optim.weight_decay, optim.betas, optim.clip_grad,
            optim.warmup_style) == (2e-5, 2e-6, 5, 0.1, [0.9, 0.95], 1.0, "cosine")
    assert optim.override_optimizer_config == {"optimizer_offload_fraction": 1, "overlap_cpu_optimizer_d2h_h2d": True,
                                               "use_precision_aware_optimizer": True, "optimizer_cpu_offload": True}
    assert (t.project_name, t.total_epochs, t.default_local_dir, t.resume_mode, t.max_actor_ckpt_to_keep,
            t.test_freq, t.logger, t.save_freq) == ("verl_sft_gsm8k", 1, "/ckpts", "auto", 10, -1, ["console", "wandb"],
                                                    500)
    # verl's SFT `checkpoint` group is the actor's checkpoint config (what its checkpoints hold)
    assert actor.checkpoint.save_contents == ["model", "optimizer", "extra"]
    warned = [r.getMessage().partition(" (verl key")[0] for r in caplog.records if "(verl key" in r.getMessage()]
    for key in ("data.pad_mode", "actor_rollout_ref.model.use_remove_padding",
                "actor_rollout_ref.actor.megatron.use_mbridge",
                "actor_rollout_ref.actor.megatron.vanilla_mbridge"):
        assert warned.count(key) == 1, key


@pytest.mark.parametrize("override, reason", [
    ("trainer.save_freq=after_each_epoch", "saving after each epoch by name is not built yet"),
    ("model.hf_config_path=/elsewhere", "megarl accepts model.hf_config_path=null only"),
    ("model.mtp.enable_rollout=true", "an SFT run has no rollout"),
    ("model.lora_rank=8", "LoRA through verl's SFT keys is not built yet"),
    ("optim.lr_warmup_init=1e-7", "warm-up starts from 0"),
    ("data.train_max_samples=100", "first rows only"),
    ("engine=fsdp", "megarl accepts engine=megatron only"),
])
def test_what_megarl_cannot_honour_is_refused_naming_the_override(override, reason):
    with pytest.raises(ConfigError) as error:
        sft(override)
    assert f"(override '{override}')" in str(error.value) and reason in str(error.value)


def test_the_dist_checkpoint_and_chat_template_keys_mean_what_they_mean_in_verls_ppo():
    config = sft("engine.use_dist_checkpointing=true", "engine.dist_checkpointing_path=/ckpt/mcore",
                 "+data.apply_chat_template_kwargs.enable_thinking=false")
    megatron = config.actor_rollout_ref.actor.megatron
    assert (megatron.use_dist_checkpointing, megatron.dist_checkpointing_path) == (True, "/ckpt/mcore")
    assert config.data.apply_chat_template_kwargs == {"enable_thinking": False}


def test_mtp_training_keys_are_the_actors_as_in_verls_sft():
    """verl's SFT trains the MTP layers with model.mtp.{enable, enable_train, detach_encoder,
    mtp_loss_scaling_factor} (docs/advance/mtp.md: the same configuration as RL)."""
    mtp = sft("model.mtp.enable=true", "model.mtp.enable_train=true", "model.mtp.detach_encoder=true",
              "model.mtp.mtp_loss_scaling_factor=0.3").actor_rollout_ref.model.mtp
    assert (mtp.enable, mtp.enable_train, mtp.detach_encoder, mtp.mtp_loss_scaling_factor) == (True, True, True, 0.3)


def test_qat_keys_are_the_actors_as_in_verls_sft():
    """verl's SFT engine (engine/megatron.yaml `qat`) quantizes the trained model as its PPO actor does."""
    qat = sft("engine.qat.enable=true", "engine.qat.ignore_patterns=[lm_head]").actor_rollout_ref.actor.megatron.qat
    assert (qat.enable, qat.mode, qat.group_size, list(qat.ignore_patterns)) == (True, "w4a16", 16, ["lm_head"])


def test_an_unknown_key_under_verls_groups_stays_unknown():
    with pytest.raises(ConfigError, match=r"override 'engine.no_such_key=1': megarl's "
                                          r"actor_rollout_ref.actor.megatron.no_such_key=1: .*unknown key"):
        sft("engine.no_such_key=1")


def test_without_verls_sft_module_its_groups_mean_nothing():
    # megarl.trainer.main_sft reads megarl's keys only
    with pytest.raises(ConfigError, match="override 'engine.tensor_model_parallel_size=2': unknown key 'engine'"):
        load_config(None, ["engine.tensor_model_parallel_size=2"])


def test_verls_file_logger_is_megarls_metrics_file(caplog):
    with caplog.at_level(logging.WARNING, "megarl.config"):
        assert sft('trainer.logger=["console","wandb","file"]').trainer.logger == ["console", "wandb"]
    assert "metrics.jsonl" in caplog.text
