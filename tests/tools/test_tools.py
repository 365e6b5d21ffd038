"""The command-line tools, run as a user would: from another directory, with the installed megarl."""
import json
import os
import subprocess
import sys
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from megarl.config import load_and_validate
from megarl.data.parquet import read_rows
from megarl.data.prompts import PromptDataset
from megarl.trainer.preflight import check_environment

REPO = Path(__file__).resolve().parents[2]
TOOLS = REPO / "tools"


def run_tool(name, *args, cwd):
    return subprocess.run(
        [sys.executable, str(TOOLS / name), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_quickstart_model_and_data_satisfy_the_quickstart_config(tmp_path, monkeypatch):
    """configs/quickstart_sft.yaml expects outputs/quickstart/model and the SFT files under
    outputs/quickstart/data; configs/quickstart.yaml the RL files there (and the SFT stage's export
    as its model, which has the same config and tokenizer)."""
    model = run_tool("make_tiny_model.py", "--arch", "qwen2", "--out", "outputs/quickstart/model", cwd=tmp_path)
    assert model.returncode == 0, model.stderr
    data = run_tool(
        "make_dataset.py", "--task", "add", "--out", "outputs/quickstart/data", "--train-size", "500", "--sft-size", "128",
        cwd=tmp_path,
    )
    assert data.returncode == 0, data.stderr
    assert "train: outputs/quickstart/data/train.parquet" in data.stdout

    monkeypatch.chdir(tmp_path)
    check_environment(load_and_validate(REPO / "configs" / "quickstart_sft.yaml"), "sft")
    config = load_and_validate(REPO / "configs" / "quickstart.yaml", ["actor_rollout_ref.model.path=outputs/quickstart/model"])
    check_environment(config)  # the model directory and the data files are where the configs say
    tokenizer = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path, local_files_only=True)
    train = PromptDataset.from_config(config.data, tokenizer, "train")
    val = PromptDataset.from_config(config.data, tokenizer, "val")
    assert (len(train), len(val), train.num_filtered, val.num_filtered) == (500, 512, 0, 0)
    net = AutoModelForCausalLM.from_pretrained(config.actor_rollout_ref.model.path, local_files_only=True)
    assert sum(p.numel() for p in net.parameters()) == 302_080
    assert (tmp_path / "outputs/quickstart/data/sft_train.parquet").is_file()


def test_make_tiny_model_options_and_errors(tmp_path):
    ok = run_tool("make_tiny_model.py", "--arch", "mistral", "--out", "m", "--layers", "1", "--hidden", "64",
                  "--heads", "2", "--kv-heads", "1", "--head-dim", "48", "--vocab", "128", "--no-tie", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["head_dim"], config["vocab_size"]) == ("mistral", 1, 48, 128)
    assert config["tie_word_embeddings"] is False
    bad = run_tool("make_tiny_model.py", "--out", "x", "--heads", "4", "--kv-heads", "3", cwd=tmp_path)
    assert bad.returncode == 2 and "heads (4) must be a multiple of kv_heads (3)" in bad.stderr


def test_make_dataset_rejects_an_unknown_task(tmp_path):
    bad = run_tool("make_dataset.py", "--task", "chess", "--out", "d", cwd=tmp_path)
    assert bad.returncode == 2 and "invalid choice: 'chess'" in bad.stderr


def test_convert_jsonl(tmp_path):
    src = tmp_path / "gsm8k.jsonl"
    src.write_text(json.dumps({"question": "2 plus 3?", "answer": "2+3=5\n#### 5"}) + "\n")
    ok = run_tool("convert_jsonl.py", src, "out/train.parquet", "--data-source", "openai/gsm8k",
                  "--answer-pattern", r"####\s*(.+)", "--instruction", "Answer after ####.", cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert "wrote 1 rows to out/train.parquet" in ok.stdout
    (row,) = read_rows(tmp_path / "out" / "train.parquet")
    assert row.ground_truth == "5" and row.messages[-1]["content"] == "2 plus 3? Answer after ####."

    src.write_text('{"question": "x"}\n')
    bad = run_tool("convert_jsonl.py", src, "o.parquet", "--data-source", "d", cwd=tmp_path)
    assert bad.returncode == 2 and "line 1: no string or number for 'answer'" in bad.stderr


def test_the_gpu_check_script_runs_its_bf16_path_on_cpu(tmp_path):
    """tools/gpu_check.py is only run for real on a lent GPU; `--cpu --dtype bfloat16` keeps every
    code path of it working here (tiny sizes: the figures mean nothing, the checks must pass).
    Checks 6-8 (the colocated path as production runs it) say in their report lines what the CPU
    leaves out."""
    r = subprocess.run([sys.executable, str(TOOLS / "gpu_check.py"), "--cpu", "--dtype", "bfloat16"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=540, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "ALL PASS" in r.stdout and "build ~1B llama (random, bfloat16): PASS" in r.stdout
    assert "'first_update_ppo_kl': 0.0" in r.stdout
    assert "colocated TP1 weight push through the tensor transport: PASS" in r.stdout
    # 6: production's world, gloo on CPU; megatron's groups inherit it
    assert "--- production's world (--cpu: gloo only, no NCCL): PASS" in r.stdout
    assert "megatron_group_backends: {'world': 'gloo', 'tensor_model_parallel': 'gloo'" in r.stdout
    # 7: the bucket's payload opened by a second process (spawn), over shared memory on CPU
    assert ("--- IPC push between two processes (--cpu: shared memory; the CUDA_VISIBLE_DEVICES spellings are "
            "GPU only): PASS") in r.stdout
    assert "'role': 'receiver', 'uuid': None, 'equal': True, 'devices': ['cpu']" in r.stdout
    # 8: the colocated moves ran to the end: the server holds all its memory, the actor none
    assert ("--- release -> push -> resume against the memory ledger (--cpu: device figures all 0, not compared): "
            "PASS") in r.stdout
    assert ("state_after: server 0: weights=resident,kv_cache=resident,cuda_graph=resident; "
            "actor: params=offloaded,grads=offloaded,optimizer=offloaded") in r.stdout
    # 9: TE's THD decision runs without TE too (test_the_thd_check_decides_as_te_on_cpu checks its figures)
    assert "--- TE's THD decision on megarl's packed micro-batch (cu [0, 5], padded [0, 8], CP 2): PASS" in r.stdout
    assert "te_attention: skipped: no GPU (TE's attention runs on CUDA only)" in r.stdout


def test_the_thd_check_decides_as_te_on_cpu(tmp_path):
    """tools/gpu_check_thd.py (gpu_check's check 9) without a GPU: megarl's packed micro-batch of one
    5-token sample at CP 2 hands TE cu_seqlens [0, 5, 9] and padded [0, 8, 12] (the filler after the
    padded sequence), on which TE 2.11's rule decides there is padding between sequences, as it would not
    on [0, 5] / [0, 8] alone; TE's own attention is skipped, saying why."""
    r = run_tool("gpu_check_thd.py", "--cpu", cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    for line in ["cu_seqlens: [0, 5, 9]", "cu_seqlens_padded: [0, 8, 12]", "max_seqlen: 8",
                 "te_pad_between_seqs_per_cp_rank: [True, True]", "te_pad_between_seqs_without_the_filler: False",
                 "te_attention: skipped: no GPU (TE's attention runs on CUDA only)",
                 "--- TE's THD decision on megarl's packed micro-batch: PASS"]:
        assert f"{line}\n" in r.stdout, line


def test_a_tiny_mtp_model_round_trips_through_both_converters(tmp_path):
    """--mtp-layers writes a DeepSeek-V3 with one multi-token-prediction layer as the hub stores it;
    the two converter scripts carry it to megatron and back with every original tensor's bytes (the
    oracle: the written file, read with safetensors)."""
    import torch
    from safetensors.torch import load_file

    made = run_tool("make_tiny_model.py", "--arch", "deepseek_v3", "--mtp-layers", "1", "--out", "hf", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_nextn_predict_layers"]) == (2, 1)
    to_megatron = run_tool("convert_hf_to_megatron.py", "--hf", "hf", "--out", "mcore", cwd=tmp_path)
    assert to_megatron.returncode == 0, to_megatron.stderr
    back = run_tool("convert_megatron_to_hf.py", "--ckpt", "mcore", "--out", "back", cwd=tmp_path)
    assert back.returncode == 0, back.stderr
    original = load_file(tmp_path / "hf" / "model.safetensors")
    returned = {}
    for path in (tmp_path / "back").glob("*.safetensors"):
        returned.update(load_file(path))
    assert any(name.startswith("model.layers.2.eh_proj") for name in original)
    assert set(returned) == set(original)
    for name, tensor in original.items():
        assert returned[name].dtype == tensor.dtype and torch.equal(returned[name], tensor), name
    bad = run_tool("make_tiny_model.py", "--arch", "qwen2", "--mtp-layers", "1", "--out", "q", cwd=tmp_path)
    assert bad.returncode == 2 and "only deepseek_v3 and glm4_moe have multi-token-prediction layers" in bad.stderr
