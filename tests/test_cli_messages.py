"""The small messages of issue 26 item 11: what `megarl plan` and `megarl check-cluster` print
when a user gets something slightly wrong, or reads a number."""
import pyarrow as pa
import pyarrow.parquet as pq

from megarl.cli import gpu_share, main
from megarl.config import load_and_validate
from megarl.launch.check import CLUSTER_FAILURE_EXIT, check_running_cluster
from megarl.placement.memory import _count

REQUIRED = ["actor_rollout_ref.model.path=/nowhere", "trainer.n_gpus_per_node=2", "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8"]


def test_gpu_shares_and_parameter_counts_read_as_people_write_them():
    assert gpu_share(1.0) == "1 GPU per rank"
    assert gpu_share(1 / 3) == "1/3 of a GPU per rank (3 ranks share each GPU)"  # was '0.333333 GPU per rank'
    assert _count(7_615_616_512) == "7.616 B"
    assert _count(302_100_000) == "302.1 M"
    assert _count(301_568) == "301,568"  # was '0.000 B'


def test_plan_reads_the_trainer_from_the_data_columns(tmp_path, capsys):
    prompt = [{"role": "user", "content": "hi"}]
    pq.write_table(pa.Table.from_pylist([{"prompt": prompt, "chosen": "a", "rejected": "b"}]), tmp_path / "prefs.parquet")
    main(["plan", *REQUIRED, f"data.train_files={tmp_path / 'prefs.parquet'}"])
    out = capsys.readouterr().out
    assert out.startswith(f"planning for the dpo trainer ({tmp_path / 'prefs.parquet'} has 'chosen' and 'rejected' "
                          "columns; --trainer rl|sft|dpo chooses)")
    assert "server(s) of TP" not in out and "ref rank 0" in out  # the policy and its frozen reference, no servers
    main(["plan", "--trainer", "rl", *REQUIRED, f"data.train_files={tmp_path / 'prefs.parquet'}"])
    out = capsys.readouterr().out
    assert "planning for" not in out and "rollout: 2 server(s) of TP 1" in out


def test_check_cluster_names_the_cluster_it_checks_or_says_why_not(monkeypatch):
    config = load_and_validate(None, REQUIRED + ["data.train_files=/d.parquet"])
    said = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert check_running_cluster(config, log=said.append) == CLUSTER_FAILURE_EXIT  # never 'auto': an unrelated Ray
    assert said == ["cluster check FAILED: RAY_ADDRESS is not set. megarl check-cluster checks the cluster a megarl "
                    "launcher started (launch/local.sh and slurm/megarl.sbatch set RAY_ADDRESS for the experiment); "
                    "to check another, set RAY_ADDRESS=<head ip>:<port>"]
    from megarl.net import free_port

    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{free_port('127.0.0.1')}")
    said.clear()
    assert check_running_cluster(config, log=said.append) == CLUSTER_FAILURE_EXIT
    assert said[0].startswith("cluster check FAILED: no Ray cluster answers at RAY_ADDRESS=127.0.0.1:")


def test_export_refuses_fp8_of_an_adapter(capsys):
    assert main(["export", "/nowhere", "--lora", "--fp8"]) == 2
    assert "megarl export: --fp8 quantizes full weights; --lora writes an adapter" in capsys.readouterr().err
