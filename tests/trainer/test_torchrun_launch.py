"""verl's SFT scripts start `torchrun --nnodes=N --nproc_per_node=G -m verl.trainer.sft_trainer ...`; renamed
to megarl's module they run under real torchrun (torch.distributed.run, the program behind `torchrun`): rank 0
is megarl's one driver, on torchrun's G GPUs (trainer.n_gpus_per_node=G whatever the command line says, as
verl's SFT trainer ignores it), the other ranks stop at once with status 0, and over several nodes rank 0
refuses with what to run instead. Each run is a `--dry-run` (config, data, model and machine checked, no Ray).
torchrun's argument forms as the corpus of verl's scripts records them are read into the same layout."""
import os
import subprocess
import sys

import pandas as pd
import pytest
from transformers import AutoTokenizer

from megarl.config import ConfigError
from megarl.config.torchrun import TorchrunLayout, layout_from_args
from megarl.data.tiny_model import make_tiny_model

TIMEOUT_S = 120
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}"
            "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %},{% endfor %}"
            "{% if add_generation_prompt %}a:{% endif %}")


@pytest.fixture(scope="module")
def sft_args(tmp_path_factory) -> list[str]:
    """verl SFT keys for a tiny model and chats, laid out on 2 GPUs (TP=2) while saying 1."""
    root = tmp_path_factory.mktemp("torchrun")
    model = make_tiny_model("qwen2", root / "model", seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(model)
    chat = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "3"}]
    pd.DataFrame({"messages": [chat] * 4}).to_parquet(root / "train.parquet")
    return ["-m", "megarl.trainer.sft_trainer", f"model.path={model}", f"data.train_files={root / 'train.parquet'}",
            "data.train_batch_size=4", "trainer.device=cpu", "engine.tensor_model_parallel_size=2",
            "trainer.n_gpus_per_node=1", "--dry-run"]


def run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S)


def test_without_torchrun_the_command_line_layout_is_refused(sft_args):
    done = run([sys.executable, *sft_args])
    assert done.returncode == 2, done.stdout + done.stderr
    assert "trainer.n_gpus_per_node" in done.stderr


def test_under_torchrun_rank_0_drives_on_torchruns_gpus_and_rank_1_stops(sft_args):
    done = run([*TORCHRUN, "--standalone", "--nnodes=1", "--nproc_per_node=2", *sft_args])
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert output.count("under torchrun: trainer.nnodes=1 trainer.n_gpus_per_node=2") == 1
    assert output.count("dry run OK") == 1
    assert "torchrun rank 1: megarl's driver runs on rank 0" in output


def test_over_two_nodes_rank_0_refuses_and_says_what_to_run(sft_args):
    """Node 0's rank 0 of `torchrun --nnodes=2 --nproc-per-node=1`, in the environment torchrun gives it (the
    variables the single-node run above reads from real torchrun). A real two-agent rendezvous is not run: on
    a worker's failure the other node's agent waits out torchrun's exit barrier (300 s)."""
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "megarl-test", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
           "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    done = subprocess.run([sys.executable, *sft_args], capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "under torchrun on 2 nodes" in done.stderr
    assert "trainer.nnodes=2 trainer.n_gpus_per_node=1" in done.stderr


@pytest.mark.parametrize("args, layout", [
    (["--nnodes=1", "--nproc_per_node=8"], TorchrunLayout(1, 8)),  # verl's run_nemotron_nano_v3_megatron.sh
    (["--nproc_per_node=8", "--nnodes=16", "--node_rank=0", "--master_addr=localhost"], TorchrunLayout(16, 8)),
    (["--standalone", "--nnodes", "2", "--nproc-per-node", "4"], TorchrunLayout(2, 4)),
    ([], TorchrunLayout(1, 1)),  # torchrun's defaults
])
def test_torchrun_arguments_read_as_torchrun_reads_them(args, layout):
    assert layout_from_args(args) == layout
    assert layout.overrides() == [f"trainer.nnodes={layout.nnodes}", f"trainer.n_gpus_per_node={layout.nproc_per_node}"]


@pytest.mark.parametrize("args, named", [(["--nnodes=1:4"], "--nnodes=1:4"),
                                         (["--nproc_per_node=auto"], "--nproc-per-node=auto")])
def test_an_elastic_or_automatic_layout_is_refused_by_name(args, named):
    with pytest.raises(ConfigError, match=named):
        layout_from_args(args)
