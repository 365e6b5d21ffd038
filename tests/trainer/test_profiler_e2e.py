"""verl's `global_profiler.tool=torch` end to end: `python -m megarl.trainer.main_ppo` on the tiny model
(TP=2 actor: two ranks, CPU-engine server), 2 steps, profiling step 2 on actor rank 1 only. Exactly
that rank's trace of that step is written, as a Chrome trace in torch.profiler's own format (its
top-level keys those of a trace torch.profiler exports here, its own record of the rank 1 of 2), recording
the step's training work."""
import gzip
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def torch_profilers_own_trace(path: Path) -> dict:
    """The oracle: what torch.profiler itself exports for a matmul (CPU activity, shapes recorded)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
        torch.ones(4, 4) @ torch.ones(4, 4)
    prof.export_chrome_trace(str(path))
    return json.loads(path.read_text())


def test_torch_trace_of_the_chosen_rank_and_step(tiny_assets, tmp_path, run_to_completion):
    prof_dir = tmp_path / "profile"
    cmd = [sys.executable, "-m", "megarl.trainer.main_ppo", "--config", str(REPO / "configs/tiny/grpo.yaml"),
           f"actor_rollout_ref.model.path={tiny_assets / 'model'}",
           f"data.train_files={tiny_assets / 'data/train.parquet'}", "data.val_files=[]",
           f"trainer.default_local_dir={tmp_path}", "trainer.n_gpus_per_node=2", "trainer.test_freq=-1",
           "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "data.train_batch_size=4",
           "actor_rollout_ref.actor.ppo_mini_batch_size=4",
           "global_profiler.tool=torch", "global_profiler.steps=[2]", f"global_profiler.save_path={prof_dir}",
           "actor_rollout_ref.actor.profiler.enable=True", "actor_rollout_ref.actor.profiler.ranks=[1]",
           "actor_rollout_ref.actor.profiler.tool_config.torch.contents=[cpu,shapes]"]
    run_to_completion(cmd, tmp_path, 400, "experiment")

    assert sorted(p.name for p in prof_dir.iterdir()) == ["actor_step2_rank1-of-2.json.gz"]
    trace = json.loads(gzip.decompress((prof_dir / "actor_step2_rank1-of-2.json.gz").read_bytes()))
    oracle = torch_profilers_own_trace(tmp_path / "oracle.json")
    assert set(oracle) <= set(trace)  # schemaVersion, deviceProperties, traceEvents, ...
    # torch.profiler's own record of the process group it ran in (added where torch.distributed is up)
    assert (trace["distributedInfo"]["rank"], trace["distributedInfo"]["world_size"]) == (1, 2)
    ops = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    names = {e["name"] for e in ops}
    # the step's training work on this rank: forward matmuls, backward, the optimizer, TP's gloo collectives
    assert "aten::matmul" in names or "aten::mm" in names, sorted(names)[:50]
    assert any("Backward" in n for n in names), sorted(names)[:50]
    assert any(n.startswith("c10d::") or "all_reduce" in n for n in names), sorted(names)[:50]
    assert any("Input Dims" in e.get("args", {}) for e in ops)  # contents=[shapes]: record_shapes
