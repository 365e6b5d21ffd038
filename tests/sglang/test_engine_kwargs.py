"""verl's actor_rollout_ref.rollout.engine_kwargs.sglang.<arg> reaches the SGLang servers megarl
launches, checked against SGLang 0.5.23 itself: megarl's table of its server arguments
(megarl.config.sglang_server_args) is what SGLang's own parser (`ServerArgs.add_cli_args`) defines,
SGLang's parser reads megarl's command back into the values given, and a real server started with
them reports them (`/get_server_info`). Refusals name the key: an argument SGLang does not have,
one megarl sets itself (the command's own value is accepted), the CPU engine; vllm / trtllm ones are
ignored with a warning each, as verl ignores them when it serves with SGLang."""
import json
import subprocess
from pathlib import Path

import pytest
import requests
from real_sglang import sglang_client_env, sglang_python, start_sglang

from megarl.config import ConfigError, load_and_validate, load_config
from megarl.config.engine_kwargs import engine_kwargs_problems, sglang_engine_flags
from megarl.config.sglang_server_args import SERVER_ARGS
from megarl.rollout.launch import sglang_server_command

REPO = Path(__file__).resolve().parents[2]
# verl's grpo_qwen35_35b_megatron_async.sh passes these (less mamba_scheduler_strategy, which SGLang 0.5.23 does
# not have, and disable_radix_cache, megarl's enable_prefix_caching); and one of each other kind
KWARGS = {"enable_memory_saver": False, "enable_weights_cpu_backup": False, "enable_draft_weights_cpu_backup": False,
          "disable_overlap_schedule": True, "chunked_prefill_size": 64, "schedule_policy": "lpm",
          "json_model_override_args": {"rope_theta": 10000}, "gc_threshold": [700, 10, 10],
          "enable_tf32_matmul": False, "enable_dp_attention": False, "disable_cuda_graph": True}
# run in SGLang's interpreter: its parser's table (as tools/sglang_server_args.py reads it) and its reading of argv
PARSE = """
import argparse, json, sys
sys.path.insert(0, sys.argv[1])
from sglang_server_args import server_args
from sglang.srt.server_args import ServerArgs
argv, dests = json.loads(sys.stdin.read())
version, table = server_args()
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
parsed = vars(parser.parse_args(argv))
print(json.dumps({"version": version, "table": table, "parsed": {d: parsed[d] for d in dests}}))
"""


def cpu_command(**kwargs) -> list[str]:
    return sglang_server_command("/m", 30000, device="cpu", context_length=256, engine_kwargs=kwargs)


@pytest.fixture(scope="module")
def sglang_reading():
    """SGLang's own table and its parse of megarl's CPU command with KWARGS."""
    command = cpu_command(**KWARGS)
    argv = command[command.index("sglang.launch_server") + 1:]
    done = subprocess.run([sglang_python(), "-c", PARSE, str(REPO / "tools")], input=json.dumps([argv, list(KWARGS)]),
                          capture_output=True, text=True, timeout=300, env=sglang_client_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_megarls_table_is_sglangs_own_parser(sglang_reading):
    assert sglang_reading["version"] == "0.5.23"
    assert {k: tuple(v) for k, v in sglang_reading["table"].items()} == SERVER_ARGS


def test_sglang_reads_megarls_command_as_the_values_given(sglang_reading):
    expected = {**KWARGS, "json_model_override_args": json.dumps(KWARGS["json_model_override_args"])}
    assert sglang_reading["parsed"] == expected


def test_a_real_server_runs_with_them(qwen2_dir, tmp_path):
    server = start_sglang(qwen2_dir, tmp_path, name="sglang-engine-kwargs",
                          engine_kwargs={"chunked_prefill_size": 64, "schedule_policy": "lpm"})
    try:
        info = requests.get(server.url + "/get_server_info", timeout=30).json()
    finally:
        server.stop()
    assert (info["chunked_prefill_size"], info["schedule_policy"]) == (64, "lpm")


def test_what_megarl_sets_itself_is_refused_unless_it_is_its_own_value():
    with pytest.raises(ValueError, match=r"engine_kwargs.sglang.attention_backend='flashinfer': megarl's command for "
                                         r"this server has --attention-backend torch_native"):
        cpu_command(attention_backend="flashinfer")  # SGLang on a CPU runs megarl's CPU flags
    assert "--attention-backend" not in cpu_command(attention_backend="torch_native")[-2:]  # the same: nothing added
    with pytest.raises(ValueError, match=r"enable_memory_saver=False: megarl's command for this server has "
                                         r"--enable-memory-saver, set by megarl \(on where a server shares"):
        sglang_engine_flags({"enable_memory_saver": False}, ["--enable-memory-saver"])
    problems = engine_kwargs_problems({"sglang": {"tp_size": 2, "mem_fraction_static": 0.5}}, "sglang")
    assert problems == ["actor_rollout_ref.rollout.engine_kwargs.sglang.tp_size=2: megarl sets it from "
                        "actor_rollout_ref.rollout.tensor_model_parallel_size",
                        "actor_rollout_ref.rollout.engine_kwargs.sglang.mem_fraction_static=0.5: megarl sets it from "
                        "actor_rollout_ref.rollout.gpu_memory_utilization"]


@pytest.mark.parametrize("override, message", [
    ("+actor_rollout_ref.rollout.engine_kwargs.sglang.mamba_scheduler_strategy=no_buffer",
     "mamba_scheduler_strategy='no_buffer': not a command-line server argument of SGLang 0.5.23"),
    ("+actor_rollout_ref.rollout.engine_kwargs.sglang.disable_cuda_graph=2",
     "SGLang's --disable-cuda-graph is a switch: true or false"),
    ("+actor_rollout_ref.rollout.engine_kwargs.sglang.chunked_prefill_size=[1,2]", "takes one value"),
])
def test_refusals_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_and_validate(None, ["actor_rollout_ref.model.path=/m", override])


def test_a_deprecated_switch_sglang_still_reads_is_passed_on_with_a_warning(caplog):
    """SGLang 0.5.23 reads --disable-cuda-graph (its parse above; arg_groups/cuda_graph_hook.py disables both
    phases' graphs), as verl's server passes it: not refused."""
    import logging

    with caplog.at_level(logging.WARNING, "megarl.config"):
        config = load_and_validate(None, ["actor_rollout_ref.model.path=/m", "data.train_files=/d.parquet",
                                          "+actor_rollout_ref.rollout.engine_kwargs.sglang.disable_cuda_graph=true"])
    assert sum("engine_kwargs.sglang.disable_cuda_graph=True: deprecated in SGLang 0.5.23, which still reads it"
               in r.getMessage() for r in caplog.records) == 1
    assert sglang_engine_flags(config.actor_rollout_ref.rollout.engine_kwargs["sglang"], []) == ["--disable-cuda-graph"]


def test_other_engines_arguments_are_ignored_with_one_warning_each(caplog):
    """verl's SGLang server reads engine_kwargs.sglang alone (verl/workers/rollout/sglang_rollout/
    async_sglang_server.py), so a verl script's vllm / trtllm arguments change nothing there: nor here."""
    import logging

    with caplog.at_level(logging.WARNING, "megarl.config"):
        config = load_and_validate(None, ["actor_rollout_ref.model.path=/m", "data.train_files=/d.parquet",
                                          "+actor_rollout_ref.rollout.engine_kwargs.vllm.max_model_len=1024",
                                          "+actor_rollout_ref.rollout.engine_kwargs.trtllm.moe_config.backend=TRTLLM"])
    for name in ("vllm.max_model_len=1024", "trtllm.moe_config={'backend': 'TRTLLM'}"):
        assert sum(f"engine_kwargs.{name} is read by verl's" in r.getMessage() for r in caplog.records) == 1, name
    assert sglang_engine_flags(config.actor_rollout_ref.rollout.engine_kwargs.get("sglang", {}), []) == []


def test_the_cpu_engine_takes_no_sglang_arguments():
    with pytest.raises(ConfigError, match="chunked_prefill_size=64: megarl's CPU engine .* is not SGLang"):
        load_and_validate(None, ["actor_rollout_ref.model.path=/m", "actor_rollout_ref.rollout.name=cpu",
                                 "+actor_rollout_ref.rollout.engine_kwargs.sglang.chunked_prefill_size=64"])


def test_verls_disable_radix_cache_is_megarls_prefix_caching_key():
    config = load_config(None, ["+actor_rollout_ref.rollout.engine_kwargs.sglang.disable_radix_cache=True"])
    assert config.actor_rollout_ref.rollout.enable_prefix_caching is False
    assert config.actor_rollout_ref.rollout.engine_kwargs == {}


def test_the_preflight_checks_them_against_the_command_for_this_machine():
    """Before any server starts (`--dry-run` too): on a CPU megarl runs SGLang with its CPU flags."""
    from megarl.trainer.preflight import engine_kwargs_problem

    config = load_and_validate(None, ["actor_rollout_ref.model.path=/m", "data.train_files=/d.parquet",
                                      "trainer.device=cpu",
                                      "+actor_rollout_ref.rollout.engine_kwargs.sglang.attention_backend=flashinfer"])
    assert "has --attention-backend torch_native" in engine_kwargs_problem(config, "cpu")
    assert engine_kwargs_problem(config, "cuda") is None
