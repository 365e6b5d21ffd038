"""verl's `actor_rollout_ref.model.mtp.*` (multi-token prediction), checked against SGLang 0.5.23 itself and
verl's own rules: with enable and enable_rollout, `speculative_*` reach SGLang as its --speculative-* flags
(SGLang's own parser reads megarl's command back into the values given), the algorithm names megarl
accepts are exactly those SGLang resolves to EAGLE drafting with the target checkpoint's own MTP layers
(`arg_groups/speculative_hook.py::_resolve_speculative_algorithm_alias`), and what is not built is refused
by name: training the MTP layers with virtual pipeline stages or LoRA (context parallelism is built), drafting
on megarl's CPU engine, vLLM's keys, a model without MTP layers."""
import json
import subprocess

import pytest
from real_sglang import make_model, sglang_client_env, sglang_python

from megarl.config import ConfigError, load_and_validate
from megarl.rollout.launch import sglang_command
from megarl.trainer.inputs import mtp_model_problem

MTP = "actor_rollout_ref.model.mtp"
BASE = ["actor_rollout_ref.model.path=/m", "data.train_files=/d.parquet"]
# verl's examples/mtp_trainer/run_mimo_7b_mtp_rl_vllm_sgl_megatron.sh, less enable_train; NEXTN as
# verl/experimental/fully_async_policy/shell/grpo_qwen35_35b_megatron_async.sh; sizes other than verl's defaults
ROLLOUT = [f"{MTP}.enable=True", f"{MTP}.enable_rollout=True", f"{MTP}.detach_encoder=True",
           f"{MTP}.mtp_loss_scaling_factor=0.2", f"{MTP}.speculative_algorithm=NEXTN", f"{MTP}.speculative_num_steps=2",
           f"{MTP}.speculative_eagle_topk=2", f"{MTP}.speculative_num_draft_tokens=5"]
DESTS = ["speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
         "enable_draft_weights_cpu_backup"]
# run in SGLang's interpreter: its parse of megarl's command, and how it resolves each algorithm name with no
# draft model path (EAGLE: the draft is the target checkpoint's own MTP layers, _handle_eagle_family)
SGLANG = """
import argparse, json, sys
from sglang.srt.server_args import ServerArgs
from sglang.srt.arg_groups.speculative_hook import _resolve_speculative_algorithm_alias
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
argv, dests = json.loads(sys.stdin.read())
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
parsed = vars(parser.parse_args(argv))
names = [a.name for a in SpeculativeAlgorithm] + ["NEXTN", "nextn", "eagle", "MEDUSA"]
resolved = {}
for name in names:
    try:
        SpeculativeAlgorithm.from_string(name)
        resolved[name] = _resolve_speculative_algorithm_alias(name.upper(), None)
    except ValueError:
        resolved[name] = None  # SGLang refuses the name
# the EAGLE worker's hand-over of the target's embedding and head to the draft (eagle_worker_v2.py), on a CPU
import torch
from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM
from sglang.srt.models.glm4_moe import Glm4MoeForCausalLM
on_cpu = {}
for cls in (DeepseekV2ForCausalLM, Glm4MoeForCausalLM):
    draft = torch.nn.Module()
    draft.model, draft.lm_head = torch.nn.Module(), torch.nn.Linear(4, 8, bias=False)
    draft.model.embed_tokens = torch.nn.Embedding(8, 4)
    try:
        cls.set_embed_and_head(draft, torch.nn.Parameter(torch.zeros(8, 4)), torch.nn.Parameter(torch.zeros(8, 4)))
        on_cpu[cls.__name__] = None
    except Exception as exc:
        on_cpu[cls.__name__] = repr(exc)
print(json.dumps({"parsed": {d: parsed[d] for d in dests}, "resolved": resolved, "on_cpu": on_cpu}))
"""


def problems(*overrides: str) -> str:
    """validate's refusal of BASE + overrides ('' when it accepts them)."""
    try:
        load_and_validate(None, [*BASE, *overrides])
    except ConfigError as exc:
        return str(exc)
    return ""


@pytest.fixture(scope="module")
def sglang_reading():
    config = load_and_validate(None, [*BASE, *ROLLOUT])
    command = sglang_command(config, "/m", 30000, device="cuda", colocated=True, context_length=512)
    argv = command[command.index("sglang.launch_server") + 1:]
    done = subprocess.run([sglang_python(), "-c", SGLANG], input=json.dumps([argv, DESTS]), capture_output=True,
                          text=True, timeout=300, env=sglang_client_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_sglang_reads_the_speculative_keys_from_megarls_command(sglang_reading):
    # colocated on GPUs: the memory saver, so the draft's weights (never pushed) are backed up as verl does
    assert sglang_reading["parsed"] == {"speculative_algorithm": "NEXTN", "speculative_num_steps": 2,
                                        "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 5,
                                        "enable_draft_weights_cpu_backup": True}


def test_the_algorithms_accepted_are_those_sglang_drafts_with_the_checkpoints_mtp_layers(sglang_reading):
    resolved = sglang_reading["resolved"]
    assert resolved["NEXTN"] == resolved["eagle"] == "EAGLE" and resolved["MEDUSA"] is None
    for name, sglangs in resolved.items():
        refused = f"{MTP}.speculative_algorithm={name!r}" in problems(*ROLLOUT, f"{MTP}.speculative_algorithm={name}")
        assert refused == (sglangs != "EAGLE"), name


def test_drafting_on_a_cpu_is_refused_where_sglangs_own_draft_set_up_fails(sglang_reading):
    assert all("CUDA" in str(error) for error in sglang_reading["on_cpu"].values()), sglang_reading["on_cpu"]
    assert "SGLang 0.5.23 cannot draft on a CPU" in problems(*ROLLOUT, "trainer.device=cpu")
    config = load_and_validate(None, [*BASE, *ROLLOUT])
    with pytest.raises(ValueError, match="SGLang on a CPU: no speculative decoding"):
        sglang_command(config, "/m", 30000, device="cpu", colocated=False, context_length=512)


def test_rollout_flags_only_with_enable_and_enable_rollout_as_verl():
    """verl's async_sglang_server.py passes speculative_* only when mtp.enable and mtp.enable_rollout."""
    for overrides in ([f"{MTP}.enable_rollout=True"], [f"{MTP}.enable=True"]):
        config = load_and_validate(None, [*BASE, *overrides])
        command = sglang_command(config, "/m", 30000, device="cuda", colocated=False, context_length=512)
        assert not [flag for flag in command if flag.startswith("--speculative")], overrides


@pytest.mark.parametrize("overrides, message", [
    ([f"{MTP}.enable_train=True", "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
      "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2"],
     f"{MTP}.enable_train=true (with actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2): "
     "not built"),
    ([f"{MTP}.enable_train=True", "actor_rollout_ref.model.lora.rank=8"], "lora.rank>0: not built"),
    (["actor_rollout_ref.rollout.name=cpu"], "megarl's CPU engine has no speculative decoding"),
    ([f"{MTP}.method=eagle"], f"{MTP}.method='eagle': vLLM's speculative decoding"),
    ([f"{MTP}.speculative_num_steps=0"], f"{MTP}.speculative_num_steps=0: a positive integer"),
])
def test_what_is_not_built_is_refused_by_name(overrides, message):
    assert message in problems(*ROLLOUT, *overrides)


def test_enable_train_is_read_only_with_enable_as_verl():
    assert problems(f"{MTP}.enable_train=True", f"{MTP}.detach_encoder=True") == ""


def test_training_the_mtp_layers_with_context_parallelism_is_accepted_as_verls_mimo_script():
    """verl's run_mimo_7b_mtp_megatron.sh trains them at context_parallel_size=2 (tests/engines/test_mtp_training.py
    checks the loss and gradients there against CP 1's)."""
    assert problems(f"{MTP}.enable=True", f"{MTP}.enable_train=True",
                    "actor_rollout_ref.actor.megatron.context_parallel_size=2") == ""


def test_training_the_mtp_layers_is_accepted_with_drafting_as_verls_script():
    """verl's run_mimo_7b_mtp_rl_vllm_sgl_megatron.sh: training and drafting with the MTP layers together."""
    assert problems(*ROLLOUT, f"{MTP}.enable_train=True") == ""


def test_a_model_without_mtp_layers_is_refused_before_any_process_starts(tmp_path):
    """verl/utils/megatron_utils.py check_mtp_config: "enable mtp while model has no mtp layer"."""
    make_model("deepseek_v3", tmp_path / "deepseek", layers=2, hidden=64, heads=2, kv_heads=1)
    config_json = tmp_path / "deepseek" / "config.json"
    hf = json.loads(config_json.read_text())
    qwen2 = make_model("qwen2", tmp_path / "qwen2", layers=1, hidden=32, heads=2, kv_heads=1)
    for path, layers, refused in ((qwen2, None, True), (tmp_path / "deepseek", 0, True),
                                  (tmp_path / "deepseek", 1, False)):
        if layers is not None:
            config_json.write_text(json.dumps({**hf, "num_nextn_predict_layers": layers}))
        config = load_and_validate(None, [f"actor_rollout_ref.model.path={path}", "data.train_files=/d.parquet",
                                          *ROLLOUT])
        problem = mtp_model_problem(config)
        assert (problem is not None) == refused, (path, layers)
        assert problem is None or "has no multi-token-prediction layers" in problem
