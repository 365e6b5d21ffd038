"""FP8 training (verl's `+actor_rollout_ref.actor.megatron.override_transformer_config.fp8=...`,
megarl.config.fp8_training): its values are megatron-core's (read from the installed megatron-core's
TransformerConfig, and 0.19.2's in /work/main/.venv312 where it is there), it is refused on a CPU at load
time and resolves on a GPU config, and each GPU decision (transformer-engine's rules) is checked per
case. verl's `rollout.enable_sleep_mode` is accepted with one warning."""
import ast
import contextlib
import dataclasses
import logging
import typing
from pathlib import Path

import pytest

from megarl.config import ConfigError, load_and_validate
from megarl.config.devices import devices_from_config
from megarl.config.fp8_training import FP8_FORMATS, FP8_RECIPES, fp8_device_problem

REQUIRED = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/models/m"]
OTC = "actor_rollout_ref.actor.megatron.override_transformer_config"
FP8 = [f"+{OTC}.fp8=hybrid", f"+{OTC}.fp8_recipe=blockwise",
       "+actor_rollout_ref.actor.optim.override_optimizer_config.fp8_recipe=blockwise"]  # verl-recipe's fp8e2e
MCORE_019 = Path("/work/main/.venv312/lib/python3.12/site-packages/megatron/core")


def _literals(annotation: ast.expr) -> list[str]:
    """The string values of `Optional[Literal[...]]` / `Literal[...]` as written in the source."""
    return [node.value for node in ast.walk(annotation) if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def _declared(path: Path, class_name: str) -> dict[str, ast.expr]:
    """Field name -> annotation of the dataclass `class_name` in the source file `path`."""
    tree = ast.parse(path.read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
    return {n.target.id: n.annotation for n in cls.body if isinstance(n, ast.AnnAssign)}


def _tiny(**fields):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, **fields)


def test_the_fp8_values_are_megatron_cores_own():
    """The formats and recipes megarl accepts are the Literal values of megatron-core's TransformerConfig
    fields, in the installed 0.16.1 (its type hints) and in 0.19.2's source where it is on this machine;
    OptimizerConfig has verl's fp8_recipe option in both."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    hints = typing.get_type_hints(TransformerConfig)
    literal = [[a for arg in typing.get_args(hints[name]) for a in typing.get_args(arg)] for name in ("fp8", "fp8_recipe")]
    assert (tuple(literal[0]), tuple(literal[1])) == (FP8_FORMATS, FP8_RECIPES)
    assert "fp8_recipe" in {f.name for f in dataclasses.fields(OptimizerConfig)}
    if MCORE_019.is_dir():
        fields = _declared(MCORE_019 / "transformer" / "transformer_config.py", "TransformerConfig")
        assert (tuple(_literals(fields["fp8"])), tuple(_literals(fields["fp8_recipe"]))) == (FP8_FORMATS, FP8_RECIPES)
        assert "fp8_recipe" in _declared(MCORE_019 / "optimizer" / "optimizer_config.py", "OptimizerConfig")


def test_megatron_core_takes_verls_fp8_settings_and_ignores_them_without_transformer_engine():
    """The oracle for the CPU refusal: megatron-core's TransformerConfig accepts fp8=hybrid with the
    blockwise recipe, and with no transformer-engine (this machine) its FP8 context is a no-op, so
    such a run would train in bf16 while saying FP8. Its own rule on fp8_param stands too."""
    from megatron.core.fp8_utils import get_fp8_context

    config = _tiny(fp8="hybrid", fp8_recipe="blockwise")
    assert (config.fp8, config.fp8_recipe) == ("hybrid", "blockwise")
    assert isinstance(get_fp8_context(config), contextlib.nullcontext)
    for fmt in FP8_FORMATS:  # every value megarl lets through is one megatron-core's config takes
        for recipe in FP8_RECIPES[:-1]:
            assert _tiny(fp8=fmt, fp8_recipe=recipe).fp8_recipe == recipe
    with pytest.raises(ValueError, match="fp8_quantizer_factory must be provided"):  # the engine turns it into
        _tiny(fp8="e4m3", fp8_recipe="custom")  # a ConfigError naming the overrides (model.build_chunks)
    with pytest.raises(ValueError, match="fp8_param must be used together with fp8 mode"):
        _tiny(fp8_param=True)


def test_fp8_training_is_refused_on_a_cpu_naming_the_key_and_resolves_on_a_gpu_config():
    with pytest.raises(ConfigError) as info:
        load_and_validate(None, REQUIRED + FP8 + ["trainer.device=cpu"])
    message = str(info.value)
    assert f"{OTC}.fp8=hybrid with trainer.device=cpu" in message
    assert "FP8 training needs a CUDA GPU" in message and "get_fp8_context is a no-op" in message
    config = load_and_validate(None, REQUIRED + FP8 + ["trainer.device=cuda"])
    assert config.actor_rollout_ref.actor.megatron.override_transformer_config == {"fp8": "hybrid",
                                                                                  "fp8_recipe": "blockwise"}
    assert config.actor_rollout_ref.actor.optim.override_optimizer_config == {"fp8_recipe": "blockwise"}
    # the reference takes the actor's overrides (verl's default), and the GPU decision lets both through
    assert config.actor_rollout_ref.ref.megatron.override_transformer_config["fp8"] == "hybrid"
    assert devices_from_config(config, cuda_available=True).device == "cuda"
    # trainer.device=auto: the machine that runs decides; on one without CUDA it is refused there
    auto = load_and_validate(None, REQUIRED + FP8)
    with pytest.raises(ConfigError, match=f"{OTC}.fp8=hybrid with trainer.device=cpu"):
        devices_from_config(auto, cuda_available=False)


def test_fp8_off_as_verl_writes_it_loads_on_a_cpu():
    config = load_and_validate(None, REQUIRED + [f"+{OTC}.fp8=False", "trainer.device=cpu"])
    assert config.actor_rollout_ref.actor.megatron.override_transformer_config == {"fp8": False}
    config = load_and_validate(None, REQUIRED + [f"+{OTC}.fp8=null", f"+{OTC}.fp8_recipe=null", "trainer.device=cpu"])
    assert config.actor_rollout_ref.actor.megatron.override_transformer_config == {"fp8": None, "fp8_recipe": None}


def test_a_reference_with_its_own_fp8_is_named():
    ref = "actor_rollout_ref.ref.megatron.override_transformer_config"
    with pytest.raises(ConfigError) as info:
        load_and_validate(None, REQUIRED + [f"+{ref}.fp8=e4m3", "trainer.device=cpu",
                                            "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=1"])
    assert f"{ref}.fp8=e4m3 with trainer.device=cpu" in str(info.value)
    assert f"{OTC}.fp8" not in str(info.value)


@pytest.mark.parametrize("overrides, message", [
    ([f"+{OTC}.fp8=e5m2"], f"{OTC}.fp8=e5m2: must be one of e4m3, hybrid"),
    ([f"+{OTC}.fp8=e4m3", f"+{OTC}.fp8_recipe=block"], f"{OTC}.fp8_recipe=block: must be one of tensorwise"),
    ([f"+{OTC}.fp8=true"], f"{OTC}.fp8=True: must be one of e4m3, hybrid"),
    ([f"+{OTC}.fp8=e4m3", f"+{OTC}.fp8_recipe=null"], f"{OTC}.fp8_recipe=None: must be one of tensorwise"),
    ([f"+{OTC}.fp8=e4m3", f"+{OTC}.fp8_param=true"], f"{OTC}.fp8_param=True: not built"),
    ([f"+{OTC}.fp8=e4m3", "actor_rollout_ref.model.lora.rank=8"],
     f"{OTC}.fp8=e4m3 with actor_rollout_ref.model.lora.rank=8: a LoRA role builds megatron's local layers"),
])
def test_fp8_settings_that_cannot_train_in_fp8_are_refused_on_a_gpu_config(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_and_validate(None, REQUIRED + overrides + ["trainer.device=cuda"])
    assert message in str(info.value)


# transformer-engine's rules (transformer_engine/pytorch/quantization.py `_compute_fp8_support`,
# `_compute_fp8_block_scaling_support`, `_compute_mxfp8_support`; megatron-core fp8_utils.get_fp8_recipe's
# minimum versions), case by case: (recipe, capability, CUDA, TE version) -> refused with this text, or None
GPU_CASES = [
    ("delayed", (9, 0), "12.4", "2.8.0", None),  # H100
    ("delayed", (8, 0), "12.4", "2.8.0", "compute capability 8.9 or higher"),  # A100
    ("tensorwise", (8, 9), "12.1", "2.8.0", None),  # L40S with CUDA 12.1
    ("delayed", (8, 9), "12.0", "2.8.0", "compute capability 8.9 or higher"),  # Ada below CUDA 12.1
    ("blockwise", (9, 0), "12.9", "2.8.0", None),
    ("blockwise", (9, 0), "12.8", "2.8.0", "block scaled GEMM requires compute capability 9.0 or higher and CUDA >= 12.9"),
    ("blockwise", (8, 9), "12.9", "2.8.0", "block scaled GEMM"),
    ("blockwise", (10, 0), "12.9", "2.8.0", None),  # B200 (the trtllm fp8e2e script's GB200)
    ("mxfp8", (9, 0), "12.9", "2.8.0", "MXFP8 at compute capability 10.0"),
    ("mxfp8", (10, 0), "12.9", "2.8.0", None),
    ("mxfp8", (12, 0), "12.9", "2.8.0", "MXFP8 at compute capability 10.0"),
    ("blockwise", (9, 0), "12.9", "2.2.0", "needs transformer-engine >= 2.3.0.dev0"),
    ("tensorwise", (9, 0), "12.9", "2.1.0", "needs transformer-engine >= 2.2.0.dev0"),
    ("delayed", (9, 0), "12.9", "1.13.0", None),
]


@pytest.mark.parametrize("recipe, capability, cuda, te, refused", GPU_CASES)
def test_fp8_on_a_gpu_follows_transformer_engines_rules(recipe, capability, cuda, te, refused):
    problem = fp8_device_problem("e4m3", recipe, on_cuda=True, transformer_engine_layers=True,
                                 capability=capability, cuda_version=cuda, te_version=te)
    assert problem is None if refused is None else refused in problem


def test_fp8_needs_transformer_engine_layers_and_nothing_is_asked_without_fp8():
    assert "needs transformer-engine layers" in fp8_device_problem(
        "hybrid", "delayed", on_cuda=True, transformer_engine_layers=False, capability=(9, 0), cuda_version="12.9")
    assert "needs a CUDA GPU" in fp8_device_problem("hybrid", "delayed", on_cuda=False, transformer_engine_layers=True)
    assert fp8_device_problem(None, "delayed", on_cuda=False, transformer_engine_layers=False) is None


def test_verls_enable_sleep_mode_is_accepted_with_one_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="megarl.config"):
        config = load_and_validate(None, REQUIRED + ["+actor_rollout_ref.rollout.enable_sleep_mode=true"])
    lines = [r.getMessage() for r in caplog.records if "enable_sleep_mode" in r.getMessage()]
    assert len(lines) == 1 and "free_cache_engine" in lines[0]
    assert config.actor_rollout_ref.rollout.free_cache_engine is True


def test_verl_recipes_dapo_config_name_loads_its_defaults_under_the_users_overrides(tmp_path, monkeypatch, caplog):
    """`--config-path=config --config-name=dapo_megatron_trainer.yaml` (verl-recipe's low_precision scripts):
    verl-recipe's dapo/config/dapo_megatron_trainer.yaml sets reward.reward_manager.name=dapo and
    trainer.project_name=verl-dapo on top of verl's ppo_megatron_trainer; an override still wins."""
    from megarl.config import load_config
    from megarl.config.args import experiment_file
    from megarl.trainer.main_ppo import build_parser

    monkeypatch.chdir(tmp_path)  # no config/ here, as in a megarl checkout
    args = build_parser().parse_intermixed_args(["--config-path=config", "--config-name=dapo_megatron_trainer.yaml",
                                                 *REQUIRED, "trainer.project_name=mine"])
    with caplog.at_level(logging.WARNING, logger="megarl.config"):
        config = load_config(experiment_file(args), args.overrides)
    assert config.reward_model.reward_manager == "dapo" and config.trainer.project_name == "mine"
    assert config.data.gen_batch_size is None and config.algorithm.filter_groups.enable is False
    assert sum("dapo_megatron_trainer" in r.getMessage() for r in caplog.records) == 1
