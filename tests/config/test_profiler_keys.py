"""verl's profiler keys (`global_profiler.*`, `<role>.profiler.*`: verl/utils/profiler/config.py,
ppo_megatron_trainer.yaml) and `actor_rollout_ref.rollout.ignore_eos` load with verl's defaults and
meanings; what megarl does not run is refused naming the key, the GPU-only tools by the device
decision (megarl.config.profiler.profiler_device_problem), tested per case."""
import pytest

from megarl.config import ConfigError, load_and_validate, load_config
from megarl.config.profiler import profiled_rank, profiled_roles, profiler_device_problem, torch_activities
from megarl.trainer.rl import sampling_params

BASE = ["actor_rollout_ref.model.path=/m", "data.train_files=/d.parquet", "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "trainer.n_gpus_per_node=1",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.rollout.name=cpu"]
TORCH_ACTOR = ["global_profiler.tool=torch", "global_profiler.steps=[1,3]", "global_profiler.save_path=/prof",
               "actor_rollout_ref.actor.profiler.enable=True", "actor_rollout_ref.actor.profiler.ranks=[1]"]


def test_verls_defaults():
    c = load_config(None, BASE)
    g = c.global_profiler
    # verl's _generated_ppo_megatron_trainer.yaml: tool null, steps null, save_path outputs/profile;
    # each role's profiler: enable false, all_ranks false, ranks [], torch contents [] and discrete false
    assert (g.tool, g.steps, g.save_path) == (None, None, "outputs/profile")
    for p in (c.actor_rollout_ref.actor.profiler, c.actor_rollout_ref.ref.profiler,
              c.actor_rollout_ref.rollout.profiler, c.critic.profiler):
        assert (p.enable, p.all_ranks, p.ranks) == (False, False, [])
        assert (p.tool_config.torch.contents, p.tool_config.torch.discrete) == ([], False)
        assert (p.tool_config.npu.level, p.tool_config.npu.analysis) == ("level0", True)
        assert (p.tool_config.torch_memory.trace_alloc_max_entries, p.tool_config.torch_memory.stack_depth) == \
            (100_000, 32)
    assert c.actor_rollout_ref.rollout.ignore_eos is False


def test_the_steps_roles_and_ranks_profiled():
    c = load_and_validate(None, BASE + TORCH_ACTOR + ["actor_rollout_ref.ref.profiler.enable=True",
                                                      "actor_rollout_ref.ref.profiler.all_ranks=True"])
    assert [profiled_roles(c, step) for step in (1, 2, 3)] == [["actor", "ref"], [], ["actor", "ref"]]
    actor, ref = c.actor_rollout_ref.actor.profiler, c.actor_rollout_ref.ref.profiler
    assert [profiled_rank(actor, r) for r in range(3)] == [False, True, False]
    assert [profiled_rank(ref, r) for r in range(3)] == [True, True, True]
    # verl's DistProfiler: enabled with no ranks listed profiles rank 0; not enabled, none
    critic = load_config(None, BASE + ["critic.profiler.enable=True"]).critic.profiler
    assert [profiled_rank(critic, r) for r in range(3)] == [True, False, False]
    assert not any(profiled_rank(c.critic.profiler, r) for r in range(3))
    # verl's RayPPOTrainer profiles nothing without steps, or without a tool
    assert profiled_roles(load_config(None, BASE + TORCH_ACTOR[:1] + TORCH_ACTOR[3:]), 1) == []
    assert profiled_roles(load_config(None, BASE + TORCH_ACTOR[1:]), 1) == []


@pytest.mark.parametrize("contents, on_cuda, expected", [
    ([], True, ("cpu", "cuda")),  # verl: empty contents collect everything
    ([], False, ("cpu",)),  # ... there is on a CPU
    (["cuda"], True, ("cpu", "cuda")),  # verl's get_torch_profiler: CPU always
    (["cpu", "shapes"], True, ("cpu",)),
    (["stack"], False, ("cpu",)),
])
def test_torch_activities_per_device(contents, on_cuda, expected):
    assert torch_activities(contents, on_cuda) == expected


@pytest.mark.parametrize("overrides, device, expected", [
    (["global_profiler.tool=nsys"], "cpu", "global_profiler.tool=nsys with trainer.device=cpu: Nsight Systems"),
    (["global_profiler.tool=nsys"], "cuda", "global_profiler.tool=nsys: not built yet"),
    (["global_profiler.tool=torch_memory"], "cpu", "global_profiler.tool=torch_memory with trainer.device=cpu"),
    (["global_profiler.tool=torch_memory"], "cuda", "global_profiler.tool=torch_memory: not built yet"),
    (["actor_rollout_ref.actor.profiler.tool_config.torch.contents=[cuda]"], "cpu",
     "actor_rollout_ref.actor.profiler.tool_config.torch.contents names cuda with trainer.device=cpu"),
    (["actor_rollout_ref.actor.profiler.tool_config.torch.contents=[cuda]"], "cuda", None),
    ([], "cpu", None),
    ([], "cuda", None),
    (["global_profiler.tool=nsys", "global_profiler.steps=null"], "cpu", None),  # nothing profiled
    (["global_profiler.tool=nsys", "actor_rollout_ref.actor.profiler.enable=False"], "cpu", None),
])
def test_device_decision_per_case(overrides, device, expected):
    problem = profiler_device_problem(load_config(None, BASE + TORCH_ACTOR + overrides), device)
    assert problem == expected if expected is None else problem.startswith(expected)


@pytest.mark.parametrize("overrides, key", [
    (["trainer.device=cpu", "global_profiler.tool=nsys"], "global_profiler.tool=nsys with trainer.device=cpu"),
    (["global_profiler.tool=npu"], "global_profiler.tool=npu: the Ascend NPU profiler"),
    (["actor_rollout_ref.rollout.profiler.enable=True"], "actor_rollout_ref.rollout.profiler.enable=true: not built"),
    (["actor_rollout_ref.actor.profiler.tool_config.torch.discrete=True"],
     "actor_rollout_ref.actor.profiler.tool_config.torch.discrete=true: not built"),
    (["actor_rollout_ref.actor.profiler.tool_config.torch.contents=[gpu]"],  # verl's own assert
     "actor_rollout_ref.actor.profiler.tool_config.torch.contents: ['gpu'] not among"),
    (["global_profiler.steps=[0]"], "global_profiler.steps=[0]: steps count from 1"),
])
def test_refusals_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_and_validate(None, BASE + TORCH_ACTOR + overrides)
    assert key in str(e.value)


def test_torch_on_cpu_and_verls_ascend_lines_without_steps_load():
    load_and_validate(None, BASE + TORCH_ACTOR + ["trainer.device=cpu"])
    # verl's examples/ascend_extras/grpo_trainer/run_qwen3_30b_a3b_megatron.sh, tool aside: steps=null
    load_and_validate(None, BASE + [
        "global_profiler.steps=null", "global_profiler.save_path=/profpath", "actor_rollout_ref.actor.profiler.enable=True",
        "actor_rollout_ref.actor.profiler.ranks=[0]", "actor_rollout_ref.actor.profiler.all_ranks=False",
        "actor_rollout_ref.actor.profiler.tool_config.npu.discrete=True",
        "actor_rollout_ref.actor.profiler.tool_config.npu.contents=[npu,cpu]",
        "actor_rollout_ref.actor.profiler.tool_config.npu.level=level0",
        "actor_rollout_ref.actor.profiler.tool_config.npu.analysis=True",
        "actor_rollout_ref.rollout.profiler.enable=True", "actor_rollout_ref.rollout.profiler.ranks=[0]",
        "actor_rollout_ref.rollout.profiler.all_ranks=False"])


@pytest.mark.parametrize("validation", [False, True])
def test_ignore_eos_reaches_every_requests_sampling_params(validation):
    # verl's vLLM server: sampling_params.setdefault("ignore_eos", config.ignore_eos) on every request,
    # validation's too (verl/workers/rollout/vllm_rollout/vllm_async_server.py)
    on = sampling_params(load_and_validate(None, BASE + ["actor_rollout_ref.rollout.ignore_eos=True"]), validation)
    off = sampling_params(load_and_validate(None, BASE), validation)
    assert on.to_json()["ignore_eos"] is True and "ignore_eos" not in off.to_json()


def test_ignore_eos_with_agents_is_refused_not_dropped():
    with pytest.raises(ConfigError) as e:
        load_and_validate(None, BASE + ["actor_rollout_ref.rollout.ignore_eos=True",
                                        "actor_rollout_ref.rollout.agent.path=/episode.py"])
    assert "actor_rollout_ref.rollout.ignore_eos=true with rollout.agent.path: not built yet" in str(e.value)
