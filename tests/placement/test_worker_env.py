"""`trainer.worker_env` (verl's `ray_kwargs.ray_init.runtime_env.env_vars.*`) reaches the Ray workers
of a run beside each worker's own variables. The oracle is Ray itself: a real local Ray cluster
started by `connect_ray`, and an actor made the way `WorkerGroup` makes its workers (its own
runtime_env env_vars) reading its environment."""
import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import ray
    from megarl.config.load import load_config
    from megarl.runtime.cluster import connect_ray

    config = load_config(None, ["trainer.n_gpus_per_node=1", "+trainer.worker_env.MEGARL_RUN_VAR=from-megarl",
                                "+ray_kwargs.ray_init.runtime_env.env_vars.MEGARL_VERL_VAR=1"])

    @ray.remote(num_cpus=0, runtime_env={"env_vars": {"MEGARL_WORKER_VAR": "from-the-worker"}})
    class Probe:
        def env(self):
            return {k: os.environ.get(k) for k in ("MEGARL_RUN_VAR", "MEGARL_VERL_VAR", "MEGARL_WORKER_VAR")}

    connect_ray(config)
    try:
        print(json.dumps(ray.get(Probe.remote().env.remote(), timeout=120)))
    finally:
        ray.shutdown()
""")


def test_worker_env_reaches_every_worker_beside_its_own_variables(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local cluster of the test's own
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=240, env=env,
                         cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen == {"MEGARL_RUN_VAR": "from-megarl", "MEGARL_VERL_VAR": "1", "MEGARL_WORKER_VAR": "from-the-worker"}
