"""verl's rollout data_parallel_size with expert parallelism reaches SGLang 0.5.23 as one server with
attention data parallelism, checked against SGLang itself: its own ServerArgs (the parser and the
resolution pipeline: `prepare_server_args`, `resolve_once`, run in SGLang's interpreter) reads
megarl's command as that layout, and refuses exactly the attention sizes megarl's config rule
refuses. The commands carry megarl's CPU flags so that SGLang resolves them on this machine: SGLang
on a CPU resolves these arguments and starts, but its scheduler dies at the first batch (the rule
`rollout_attention_data_parallel_fits_server` refuses that case, citing the error), so no server runs."""
import json
import subprocess

import pytest
from real_sglang import CONTEXT, sglang_client_env, sglang_python

from megarl.config import ConfigError, load_and_validate
from megarl.rollout.launch import sglang_command, sglang_server_command

R = "actor_rollout_ref.rollout."
VERL_397B = (f"{R}tensor_model_parallel_size=2", f"{R}data_parallel_size=2", f"{R}expert_parallel_size=4")
VERL_DP_ATTENTION = (f"{R}tensor_model_parallel_size=2", f"{R}data_parallel_size=2",
                     f"+{R}engine_kwargs.sglang.enable_dp_attention=true")
# (server GPUs, attention groups): megarl's rule and SGLang's resolution must agree on each
SIZES = [(4, 2), (4, 3), (4, 4), (8, 4), (8, 3), (8, 6)]
# run in SGLang's interpreter: each argv resolved as `sglang serve` resolves it, or the error it raises
RESOLVE = """
import json, sys, traceback
from sglang.srt.server_args import prepare_server_args
out = []
for argv in json.loads(sys.stdin.read()):
    try:
        args = prepare_server_args(argv)
        args.resolve_once()
    except (AssertionError, ValueError) as error:
        where = traceback.extract_tb(error.__traceback__)[-1]
        out.append({"refused": f"{type(error).__name__} in {where.name}: {error}"})
        continue
    resolved = args.resolved_dict()
    out.append({k: resolved[k] for k in ("tp_size", "dp_size", "attn_dp_size", "ep_size", "enable_dp_attention")})
print(json.dumps(out))
"""


def _argv(command: list[str]) -> list[str]:
    return command[command.index("sglang.launch_server") + 1:]


def _config(*overrides):
    return load_and_validate(None, ["actor_rollout_ref.model.path=/m", "data.train_files=/d.parquet",
                                    f"{R}name=sglang", "trainer.n_gpus_per_node=8", *overrides])


@pytest.fixture(scope="module")
def resolved(qwen2_dir):
    """SGLang's resolution of megarl's command for verl's layout (the 397B script's, scaled to
    tp 2 x dp 2, ep 4), then of a plain command for each of SIZES."""
    config = _config(*VERL_397B)
    commands = [sglang_command(config, qwen2_dir, 30000, device="cpu", colocated=False, context_length=CONTEXT)]
    commands += [sglang_server_command(qwen2_dir, 30000, device="cpu", context_length=CONTEXT, tp_size=tp,
                                       attn_dp_size=attn_dp) for tp, attn_dp in SIZES]
    # verl's layout without expert parallelism, DP attention asked through engine_kwargs: megarl's command, then
    # verl's server arguments for it (async_sglang_server.py: tp_size tp x dp, dp_size dp, the engine_kwargs)
    commands.append(sglang_command(_config(*VERL_DP_ATTENTION), qwen2_dir, 30000, device="cpu", colocated=False,
                                   context_length=CONTEXT))
    commands.append([*sglang_server_command(qwen2_dir, 30000, device="cpu", context_length=CONTEXT, tp_size=4),
                     "--dp-size", "2", "--enable-dp-attention"])
    done = subprocess.run([sglang_python(), "-c", RESOLVE], input=json.dumps([_argv(c) for c in commands]),
                          capture_output=True, text=True, timeout=300, env=sglang_client_env())
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_sglang_reads_verls_layout_as_one_server_with_attention_dp(resolved):
    """tp x dp = 4 GPUs in one server (no data-parallel replicas), attention in 2 groups, the experts
    over all 4: SGLang's own reading, including its deprecated `enable_dp_attention`, which its
    resolved_dict reports set whenever attention DP runs."""
    assert resolved[0] == {"tp_size": 4, "dp_size": 1, "attn_dp_size": 2, "ep_size": 4, "enable_dp_attention": True}


@pytest.mark.parametrize("index", range(len(SIZES)))
def test_megarls_rule_refuses_what_sglang_refuses(resolved, index):
    tp, attn_dp = SIZES[index]
    sglang = resolved[1 + index]
    overrides = (f"{R}tensor_model_parallel_size={tp}", f"{R}attention_data_parallel_size={attn_dp}")
    if "refused" in sglang:
        assert sglang["refused"].startswith("AssertionError in handle_data_parallelism")
        with pytest.raises(ConfigError, match=f"attention_data_parallel_size={attn_dp} must divide "
                                              f"{R}tensor_model_parallel_size={tp}"):
            _config(*overrides)
    else:
        assert (sglang["tp_size"], sglang["attn_dp_size"], sglang["dp_size"]) == (tp, attn_dp, 1)
        r = _config(*overrides).actor_rollout_ref.rollout
        assert (r.tensor_model_parallel_size, r.attention_data_parallel_size) == (tp, attn_dp)


def test_verls_dp_attention_flag_reaches_sglang_as_verls_own_server_arguments_do(resolved):
    """`engine_kwargs.sglang.enable_dp_attention=true` beside data_parallel_size 2 (expert_parallel_size 1):
    SGLang resolves megarl's command exactly as verl's own server arguments (tp_size 4, dp_size 2, the flag):
    one server of 4 GPUs, attention in 2 groups, no replicas."""
    megarl, verl = resolved[-2], resolved[-1]
    assert verl == {"tp_size": 4, "dp_size": 1, "attn_dp_size": 2, "ep_size": 1, "enable_dp_attention": True}
    assert megarl == verl
