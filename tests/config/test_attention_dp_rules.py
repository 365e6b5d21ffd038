"""actor_rollout_ref.rollout.attention_data_parallel_size (SGLang's --attn-dp-size) where it cannot run:
megarl's CPU engine (one process, no attention groups) and SGLang 0.5.23 on a CPU (measured: the server
starts with `--tp-size 2 --attn-dp-size 2`, then its scheduler dies at the first batch with
"AttributeError: 'TorchNativeAttnBackend' object has no attribute 'get_cpu_graph_seq_len_fill_value'").
Whether a size divides the server's GPUs is held to SGLang's own resolution in
tests/sglang/test_attention_dp_args.py; the weight push is unchanged (the server's TP ranks stay its
tensor_model_parallel_size: tests/sglang/test_attention_dp_args.py reads SGLang's tp_size)."""
import pytest

from config_cases import fails, ok
from megarl.config.engine_kwargs import engine_kwargs_problems

R = "actor_rollout_ref.rollout."
LAYOUT = (f"{R}tensor_model_parallel_size=4", f"{R}attention_data_parallel_size=2", "trainer.n_gpus_per_node=8")


def test_sglang_on_gpus_takes_it():
    config = ok(*LAYOUT, f"{R}name=sglang", "trainer.device=cuda")
    assert config.actor_rollout_ref.rollout.attention_data_parallel_size == 2


@pytest.mark.parametrize("overrides, message", [
    ((f"{R}name=cpu",), f"{R}attention_data_parallel_size=2: megarl's CPU engine"),
    ((f"{R}name=sglang", "trainer.device=cpu"),
     f"{R}attention_data_parallel_size=2 with rollout.name=sglang and trainer.device=cpu: SGLang 0.5.23 on a CPU "
     "starts with --attn-dp-size but its scheduler dies at the first batch"),
    ((f"{R}attention_data_parallel_size=0",), f"{R}attention_data_parallel_size=0: must be a positive integer"),
])
def test_where_it_cannot_run_it_is_refused(overrides, message):
    assert message in fails(*LAYOUT, *overrides)


def test_engine_kwargs_cannot_set_it_behind_megarls_key():
    assert engine_kwargs_problems({"sglang": {"attn_dp_size": 2}}, "sglang") == [
        f"{R}engine_kwargs.sglang.attn_dp_size=2: megarl sets it from {R}attention_data_parallel_size"]
