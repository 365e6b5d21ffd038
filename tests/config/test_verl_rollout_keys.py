"""verl's rollout keys beside SGLang's server layout (megarl.config.verl_compat `_rollout_parallel`,
`_multi_turn`), each checked against an independent oracle: SGLang 0.5.23's own width derivation
(sglang/srt/runtime_context.py `derive_parallel_widths`, executed from SGLang's source), and verl
0.9.1's own config (its wheel: RolloutConfig's asserts and server arguments, MultiTurnConfig's
fields, rollout.yaml's keys)."""
import ast
import logging
import os
import zipfile
from pathlib import Path

import pytest
import yaml

from config_cases import fails, ok
from megarl.config.verl_compat import _MULTI_TURN

REPO = Path(__file__).resolve().parents[2]
WHEEL = Path(os.environ.get("MEGARL_VERL_WHEEL") or REPO / ".verl-oracle" / "verl-0.9.1-py3-none-any.whl")
# SGLang's source beside its interpreter ($MEGARL_SGLANG_PYTHON, as tests/sglang/real_sglang.py finds it)
SGLANG_PYTHON = Path(os.environ.get("MEGARL_SGLANG_PYTHON") or REPO / ".venv-sglang" / "bin" / "python")
SGLANG = SGLANG_PYTHON.parents[1] / "lib" / "python3.11" / "site-packages" / "sglang"
R = "actor_rollout_ref.rollout."


def _verl(path: str) -> str:
    if not WHEEL.is_file():
        pytest.fail(f"verl 0.9.1's wheel is not at {WHEEL}: run `make install-verl-oracle` (or set MEGARL_VERL_WHEEL)")
    with zipfile.ZipFile(WHEEL) as wheel:
        return wheel.read(path).decode()


def _sglang_widths(tp: int, ep: int, attn_dp: int = 1) -> dict:
    """SGLang 0.5.23's derived widths at --tp-size tp --ep-size ep --attn-dp-size attn_dp: its
    derive_parallel_widths, run from its source."""
    source = SGLANG / "srt" / "runtime_context.py"
    if not source.is_file():
        pytest.fail(f"SGLang 0.5.23 is not at {SGLANG} (set MEGARL_SGLANG_PYTHON to its interpreter)")
    tree = ast.parse(source.read_text())
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef)
                 and n.name in ("derive_parallel_widths", "derive_attn_tp_size")]
    namespace: dict = {}
    exec(compile(ast.Module(body=functions, type_ignores=[]), str(source), "exec"), namespace)
    return namespace["derive_parallel_widths"](tp_size=tp, attn_cp_size=1, attn_dp_size=attn_dp, moe_ep_size=ep,
                                                moe_dp_size=1, dcp_size=1, dcp_enabled=False)


@pytest.mark.parametrize("tp, ep, moe_tp", [(4, 2, 2), (4, 2, 1), (4, 2, 4), (8, 8, 1), (8, 2, 2), (2, 1, 2)])
def test_moe_tensor_parallel_size_is_accepted_where_sglang_derives_it(tp, ep, moe_tp, caplog):
    """verl refuses moe_tensor_parallel_size > 1 off TensorRT-LLM (its own assert, read from the wheel);
    megarl accepts 1 (verl's default, no effect) and the MoE TP SGLang itself derives from tp and ep."""
    assert 'assert self.name == "trtllm", "moe_tensor_parallel_size is only supported for trtllm"' in _verl(
        "verl/workers/config/rollout.py")
    overrides = (f"{R}tensor_model_parallel_size={tp}", f"{R}expert_parallel_size={ep}",
                 f"+{R}moe_tensor_parallel_size={moe_tp}", "trainer.n_gpus_per_node=8")
    if moe_tp == 1 or moe_tp == _sglang_widths(tp, ep)["moe_tp_size"]:
        with caplog.at_level(logging.WARNING, "megarl.config"):
            ok(*overrides)
        assert sum(f"{R}moe_tensor_parallel_size={moe_tp} (verl key" in r.message for r in caplog.records) == 1
    else:
        assert (f"{R}moe_tensor_parallel_size={moe_tp} (override '+{R}moe_tensor_parallel_size={moe_tp}'): verl reads "
                "it for TensorRT-LLM only") in fails(*overrides)


def test_data_parallel_size_is_servers_behind_the_router_or_attention_dp_with_experts(caplog):
    """verl's SGLang server takes tp_size = tp x dp, dp_size = dp, ep_size = ep (its server arguments,
    read from the wheel); with ep = 1 that is dp-way data parallelism, which megarl's servers behind
    sglang-router are (one warning); with ep > 1 (verl: ep = tp x dp) one server spans tp x dp GPUs,
    its experts over all of them and its attention in dp groups of tp: megarl's
    tensor_model_parallel_size tp x dp and attention_data_parallel_size dp, whose attention TP width
    SGLang derives (derive_attn_tp_size, run from its source) as verl's tp."""
    server = _verl("verl/workers/rollout/sglang_rollout/async_sglang_server.py")
    assert "infer_tp = self.config.tensor_model_parallel_size * self.config.data_parallel_size" in server
    assert '"dp_size": self.config.data_parallel_size,' in server and '"tp_size": infer_tp,' in server
    assert "assert self.expert_parallel_size == (self.tensor_model_parallel_size * self.data_parallel_size)" in _verl(
        "verl/workers/config/rollout.py")
    with caplog.at_level(logging.WARNING, "megarl.config"):
        config = ok(f"{R}tensor_model_parallel_size=2", f"{R}data_parallel_size=4", "trainer.n_gpus_per_node=8")
    assert config.actor_rollout_ref.rollout.tensor_model_parallel_size == 2
    assert config.actor_rollout_ref.rollout.attention_data_parallel_size == 1
    assert sum(f"{R}data_parallel_size=4 (verl key" in r.message for r in caplog.records) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, "megarl.config"):
        config = ok(f"{R}tensor_model_parallel_size=2", f"{R}data_parallel_size=4", f"{R}expert_parallel_size=8",
                    "trainer.n_gpus_per_node=8")
    r = config.actor_rollout_ref.rollout
    assert (r.tensor_model_parallel_size, r.attention_data_parallel_size, r.expert_parallel_size) == (8, 4, 8)
    assert _sglang_widths(8, 8, attn_dp=4)["attn_tp_size"] == 2
    assert sum(f"{R}data_parallel_size=4 (verl key" in r.message and "--tp-size 8 --attn-dp-size 4 --ep-size 8"
               in r.message for r in caplog.records) == 1
    # megarl's own key, given beside verl's: the same value is accepted, another refused
    assert ok(f"{R}tensor_model_parallel_size=2", f"{R}data_parallel_size=4", f"{R}expert_parallel_size=8",
              f"{R}attention_data_parallel_size=4", "trainer.n_gpus_per_node=8")
    assert (f"{R}data_parallel_size=4 (override '{R}data_parallel_size=4') with expert_parallel_size=8 means "
            f"{R}attention_data_parallel_size=4, which contradicts {R}attention_data_parallel_size=2") in fails(
        f"{R}tensor_model_parallel_size=2", f"{R}data_parallel_size=4", f"{R}expert_parallel_size=8",
        f"{R}attention_data_parallel_size=2", "trainer.n_gpus_per_node=8")
    assert f"{R}data_parallel_size=0 (override '{R}data_parallel_size=0'): must be a positive integer" in fails(
        f"{R}data_parallel_size=0")


def test_single_turn_response_length_is_no_key_of_verls():
    """The one script naming it sets it without '+', and verl's rollout config has no such key (its
    rollout.yaml and RolloutConfig, read from the wheel): Hydra refuses it, so megarl does, saying so."""
    assert "single_turn_response_length" not in yaml.safe_load(_verl("verl/trainer/config/rollout/rollout.yaml"))
    assert "single_turn_response_length" not in _verl("verl/workers/config/rollout.py")
    assert "verl too: no such key in verl's rollout config" in fails(f"{R}single_turn_response_length=4096")


def _multi_turn_fields() -> list[str]:
    tree = ast.parse(_verl("verl/workers/config/rollout.py"))
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MultiTurnConfig"]
    return [n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and not n.target.id.startswith("_")]


def test_multi_turn_keys_are_verls_and_map_to_megarls_agent_settings(caplog):
    """Every field of verl's MultiTurnConfig is known; max_assistant_turns is megarl's agent.max_turns
    (model calls per episode); the tool agent loop's limits load with one warning each, its tools are
    refused (not built); agent.num_workers (verl's agent loop processes) loads with one warning."""
    assert list(_MULTI_TURN) == _multi_turn_fields()
    given = (f"{R}multi_turn.enable=True", f"{R}multi_turn.max_user_turns=6", f"{R}multi_turn.max_assistant_turns=5",
             f"{R}multi_turn.max_tool_response_length=12288", f"{R}agent.num_workers=2")
    with caplog.at_level(logging.WARNING, "megarl.config"):
        config = ok(*given)
    assert config.actor_rollout_ref.rollout.agent.max_turns == 5
    for text in given:
        assert sum(f"override '{text}'" in r.message for r in caplog.records) == 1, text
    # null (verl: no limit of its own): megarl's default stands
    assert ok(f"{R}multi_turn.max_assistant_turns=null").actor_rollout_ref.rollout.agent.max_turns == 8
    assert "verl's tool agent loop (tools from tool_config_path / function_tool_path) is not built" in fails(
        f"{R}multi_turn.tool_config_path=/tools.yaml")
    assert "not a key of verl's multi_turn config" in fails(f"{R}multi_turn.max_turns=3")
