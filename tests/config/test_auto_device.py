"""`trainer.device=auto` is decided on the controller (megarl.config.devices.auto_device_refusal):
refused where the controller sees no CUDA GPU but the job has GPUs, per case on CPU. The oracles:
Slurm's documented variables (man sbatch, OUTPUT ENVIRONMENT VARIABLES) and CUDA's reading of
CUDA_VISIBLE_DEVICES (the devices before the first invalid entry), by hand; and the trainer's own
preflight, which gathers the facts from torch, the environment and the Ray cluster it joined."""
import pytest

from megarl.config import ConfigError, devices, load_and_validate

REQUIRED = ["data.train_files=/d/train.parquet", "actor_rollout_ref.model.path=/models/m",
            "actor_rollout_ref.rollout.name=cpu"]
# the variables that can show a job's GPUs (Slurm's man sbatch / srun; CUDA's CUDA_VISIBLE_DEVICES)
GPU_VARIABLES = ("SLURM_GPUS_ON_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_GPUS", "SLURM_GPUS_PER_NODE",
                 "CUDA_VISIBLE_DEVICES")


@pytest.mark.parametrize("env, shown", [
    ({}, ()),
    ({"SLURM_GPUS_ON_NODE": "8"}, ("SLURM_GPUS_ON_NODE=8",)),  # the batch step holds 8 GPUs
    ({"SLURM_GPUS_ON_NODE": "0"}, ()),
    ({"SLURM_JOB_GPUS": "0,1,2,3"}, ("SLURM_JOB_GPUS=0,1,2,3",)),  # global ids of the job's GPUs
    ({"SLURM_JOB_GPUS": ""}, ()),
    ({"SLURM_STEP_GPUS": "2"}, ("SLURM_STEP_GPUS=2",)),
    ({"SLURM_GPUS_PER_NODE": "8"}, ("SLURM_GPUS_PER_NODE=8",)),  # slurm/megarl.sbatch's --gpus-per-node
    ({"SLURM_GPUS_PER_NODE": "h100:8"}, ("SLURM_GPUS_PER_NODE=h100:8",)),  # [type:]count
    ({"SLURM_GPUS": "a100:0,h100:2"}, ("SLURM_GPUS=a100:0,h100:2",)),
    ({"SLURM_GPUS": "0"}, ()),
    ({"CUDA_VISIBLE_DEVICES": "0,1"}, ("CUDA_VISIBLE_DEVICES=0,1",)),
    ({"CUDA_VISIBLE_DEVICES": "GPU-5c3a,GPU-77d1"}, ("CUDA_VISIBLE_DEVICES=GPU-5c3a,GPU-77d1",)),
    ({"CUDA_VISIBLE_DEVICES": "MIG-1f2e"}, ("CUDA_VISIBLE_DEVICES=MIG-1f2e",)),
    ({"CUDA_VISIBLE_DEVICES": "-1"}, ()),  # an invalid first entry: CUDA shows no device
    ({"CUDA_VISIBLE_DEVICES": "-1,0"}, ()),  # ... nor any after it
    ({"CUDA_VISIBLE_DEVICES": ""}, ()),
    ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, ()),  # Slurm's value for a step without GPU device files
    ({"SLURM_CPUS_ON_NODE": "64", "PATH": "/bin"}, ()),  # other variables say nothing
    ({"CUDA_VISIBLE_DEVICES": "3", "SLURM_GPUS_ON_NODE": "1"}, ("SLURM_GPUS_ON_NODE=1", "CUDA_VISIBLE_DEVICES=3")),
])
def test_job_gpu_env_names_exactly_the_variables_that_show_gpus(env, shown):
    assert devices.job_gpu_env(env) == shown


@pytest.mark.parametrize("cuda_available, cluster_gpus, env, refused", [
    (False, None, {}, False),  # a CPU machine, no cluster yet: auto is CPU
    (False, 0.0, {}, False),  # joined a cluster without GPUs
    (False, 16.0, {}, True),  # the joined cluster advertises GPUs the controller cannot see
    (False, None, {"SLURM_GPUS_PER_NODE": "8"}, True),  # an sbatch step without GPUs, before Ray starts
    (False, None, {"SLURM_JOB_GPUS": "0,1"}, True),
    (False, None, {"CUDA_VISIBLE_DEVICES": "0"}, True),  # GPUs named, none usable (driver, CPU-only torch)
    (False, None, {"CUDA_VISIBLE_DEVICES": "-1"}, False),
    (True, 16.0, {"SLURM_GPUS_PER_NODE": "8"}, False),  # the controller sees CUDA: auto is CUDA, as asked
    (True, None, {}, False),
])
def test_auto_is_refused_exactly_where_the_controller_sees_no_cuda_but_the_job_has_gpus(cuda_available, cluster_gpus,
                                                                                       env, refused):
    problem = devices.auto_device_refusal("auto", cuda_available, cluster_gpus, env)
    assert (problem is not None) == refused
    if refused:
        assert problem.startswith("trainer.device=auto is decided on this controller, which sees no CUDA GPU")
        assert "Set trainer.device=cuda" in problem and "trainer.device=cpu" in problem
        if cluster_gpus:
            assert f"advertises {cluster_gpus:g} GPU(s)" in problem
        for name, value in env.items():
            assert f"{name}={value}" in problem  # what showed the GPUs


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_an_explicit_device_is_the_users_decision_and_never_refused_here(device):
    assert devices.GPU_ENV_VARS == GPU_VARIABLES
    everything = {name: "1" for name in GPU_VARIABLES}
    for cuda_available in (True, False):
        assert devices.auto_device_refusal(device, cuda_available, 8.0, everything) is None


# ------------------------------------------------------------------------------------- the trainer gathers the facts
@pytest.fixture
def no_gpu_env(monkeypatch):
    for name in GPU_VARIABLES + ("RAY_ADDRESS",):
        monkeypatch.delenv(name, raising=False)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # an sbatch step that cannot see the GPUs


def test_the_trainer_refuses_auto_in_a_slurm_step_without_gpus(no_gpu_env, monkeypatch):
    from megarl.runtime.devices import resolve_devices

    config = load_and_validate(None, REQUIRED)
    assert config.trainer.device == "auto"
    assert resolve_devices(config).device == "cpu"  # a CPU machine: CPU, as before
    monkeypatch.setenv("SLURM_GPUS_PER_NODE", "8")
    with pytest.raises(ConfigError, match=r"trainer\.device=auto is decided on this controller.*SLURM_GPUS_PER_NODE=8"):
        resolve_devices(config)
    # the explicit choice the message asks for runs (here on CPU: the test's controller has no CUDA)
    assert resolve_devices(load_and_validate(None, REQUIRED + ["trainer.device=cpu"])).device == "cpu"


def test_the_trainer_refuses_auto_when_the_ray_cluster_it_joined_has_gpus(no_gpu_env, monkeypatch):
    import ray

    from megarl.runtime.devices import resolve_devices

    config = load_and_validate(None, REQUIRED)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 64.0, "GPU": 16.0})
    # a cluster started here (no RAY_ADDRESS: `connect_ray`'s local one, with the config's logical GPUs)
    assert resolve_devices(config).device == "cpu"
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # joined: the launcher's cluster
    with pytest.raises(ConfigError, match=r"the Ray cluster it joined \(RAY_ADDRESS\) advertises 16 GPU\(s\)"):
        resolve_devices(config)


def test_check_environment_reports_it_among_the_machines_problems(no_gpu_env, monkeypatch):
    """`--dry-run` and the run's first check (before Ray starts) name it with the other problems."""
    from megarl.trainer.preflight import check_environment

    monkeypatch.setenv("SLURM_JOB_GPUS", "0,1,2,3")
    with pytest.raises(ConfigError) as info:
        check_environment(load_and_validate(None, REQUIRED))
    assert "  - trainer.device=auto is decided on this controller" in str(info.value)
    assert "SLURM_JOB_GPUS=0,1,2,3" in str(info.value)


def test_the_rules_that_read_the_device_apply_to_what_auto_resolves_to(no_gpu_env):
    """A config valid under trainer.device=auto (SGLang's attention DP, refused on a CPU only) is
    refused at launch where auto resolves to the CPU, naming the rule's message and the resolution."""
    from megarl.trainer.preflight import check_environment

    layout = ["actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
              "actor_rollout_ref.rollout.attention_data_parallel_size=2", "trainer.n_gpus_per_node=2"]
    config = load_and_validate(None, [*REQUIRED, *layout])  # valid: on a GPU it runs
    with pytest.raises(ConfigError, match="attention_data_parallel_size=2"):
        load_and_validate(None, [*REQUIRED, *layout, "trainer.device=cpu"])
    with pytest.raises(ConfigError) as info:
        check_environment(config)
    assert "attention_data_parallel_size=2 with rollout.name=sglang and trainer.device=cpu" in str(info.value)
    assert "(trainer.device=auto is cpu on this machine)" in str(info.value)
