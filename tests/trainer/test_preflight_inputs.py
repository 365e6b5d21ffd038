"""The checks a run makes before Ray starts (and --dry-run makes too): data footers and first rows,
the model's config and tokenizer (a hub id through the HF cache), the schedule the data allows and
the GPUs this machine shows. Issue 26 items 1, 3 and 4: each bad input below used to pass --dry-run
and fail 35-76 s into the run, after the cluster was up."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.config import ConfigError, load_and_validate
from megarl.trainer.inputs import gpu_count_problem
from megarl.trainer.preflight import check_environment

REPO = Path(__file__).resolve().parents[2]
CPU = ["trainer.device=cpu", "actor_rollout_ref.rollout.name=cpu", "trainer.n_gpus_per_node=2",
       "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.n=2"]
ROW = {"data_source": "add", "prompt": [{"role": "user", "content": "1+1="}], "ability": "math",
       "reward_model": {"style": "rule", "ground_truth": "2"}}


def _config(model, train, *more):
    return load_and_validate(None, CPU + [f"actor_rollout_ref.model.path={model}", f"data.train_files={train}", *more])


def _problems(config, kind="rl") -> str:
    with pytest.raises(ConfigError) as info:
        check_environment(config, kind)
    return str(info.value)


def test_bad_data_is_named_by_file_row_and_column_before_anything_starts(tiny_assets, tmp_path):
    good = tiny_assets / "data/train.parquet"
    (tmp_path / "random.parquet").write_bytes(os.urandom(4096))
    pq.write_table(pa.Table.from_pylist([{k: v for k, v in ROW.items() if k != "prompt"}] * 3),
                   tmp_path / "no_prompt.parquet")
    pq.write_table(pa.Table.from_pylist([ROW]).slice(0, 0), tmp_path / "empty.parquet")
    pq.write_table(pa.Table.from_pylist([ROW, {**ROW, "reward_model": {"style": "rule", "ground_truth": None}}]),
                   tmp_path / "null_truth.parquet")
    files = [tmp_path / n for n in ("random.parquet", "no_prompt.parquet", "empty.parquet", "null_truth.parquet")]
    config = _config(tiny_assets / "model", "[" + ",".join(map(str, files)) + "]")
    started = time.monotonic()
    text = _problems(config)
    seconds = time.monotonic() - started
    assert f"data.train_files: {tmp_path}/random.parquet: not a readable parquet file" in text
    assert f"{tmp_path}/no_prompt.parquet: missing column(s) 'prompt'" in text
    assert f"{tmp_path}/empty.parquet: the file has no rows" in text
    assert f"{tmp_path}/null_truth.parquet: row 1, column 'reward_model': 'ground_truth' is missing or null" in text
    assert seconds < 30, seconds  # reads footers and first rows: well under a second unloaded
    check_environment(_config(tiny_assets / "model", good))  # the control: good data passes


def test_a_directory_as_data_and_too_few_rows_for_a_batch(tiny_assets):
    text = _problems(_config(tiny_assets / "model", tiny_assets / "data"))
    assert f"data.train_files: {tiny_assets}/data is a directory (it holds train.parquet, val.parquet)" in text
    text = _problems(_config(tiny_assets / "model", tiny_assets / "data/val.parquet", "data.train_batch_size=32",
                             "actor_rollout_ref.actor.ppo_mini_batch_size=32"))
    assert "data.train_files hold 16 rows, fewer than one batch (data.train_batch_size=32)" in text


def test_sft_data_needs_its_response_column(tiny_assets):
    text = _problems(_config(tiny_assets / "model", tiny_assets / "data/train.parquet"), "sft")
    assert "missing column(s) 'response'" in text


def test_model_config_and_tokenizer_are_checked(tiny_assets, tmp_path):
    broken = tmp_path / "model"
    shutil.copytree(tiny_assets / "model", broken)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (broken / name).unlink()
    text = _problems(_config(broken, tiny_assets / "data/train.parquet"))
    assert f"actor_rollout_ref.model.path: no tokenizer files in {broken}" in text
    (broken / "config.json").write_text('{"model_type": "gpt2"}')
    text = _problems(_config(broken, tiny_assets / "data/train.parquet"))
    assert f"{broken}/config.json: `model_type`='gpt2' is not supported: megarl maps these HF architectures" in text


# config.json of models megarl does not map onto megatron-core (their fields as their HF configs have them,
# trimmed; no weights: the check reads config.json only)
# NVIDIA-Nemotron-Nano-9B-v2's (a hybrid of Mamba-2 and attention layers)
NEMOTRON_H = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "hidden_size": 4480,
              "num_hidden_layers": 56, "num_attention_heads": 40, "num_key_value_heads": 8, "vocab_size": 131072,
              "hybrid_override_pattern": "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"}
QWEN3_5 = {"architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "hidden_size": 2048,
           "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 2, "vocab_size": 248320,
           "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]}
# Qwen2.5-Math-RM-72B, whole: a known model_type whose class has weights of its own (a two-layer score head);
# before, it passed as a causal LM
QWEN2_RM = {"architectures": ["Qwen2ForRewardModel"], "model_type": "qwen2", "hidden_act": "silu",
            "hidden_size": 8192, "intermediate_size": 29568, "max_position_embeddings": 4096, "num_attention_heads": 64,
            "num_hidden_layers": 80, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
            "sliding_window": 4096, "tie_word_embeddings": False, "use_sliding_window": False, "vocab_size": 152064}
SUPPORTED = ("LlamaForCausalLM (llama), MistralForCausalLM (mistral), Qwen2ForCausalLM (qwen2), Qwen3ForCausalLM "
             "(qwen3), Qwen2MoeForCausalLM (qwen2_moe), Qwen3MoeForCausalLM (qwen3_moe), MixtralForCausalLM "
             "(mixtral), GptOssForCausalLM (gpt_oss), DeepseekV3ForCausalLM (deepseek_v3), Glm4MoeForCausalLM "
             "(glm4_moe); and each one's *ForSequenceClassification with num_labels=1 as a reward model")


def model_dir_with(config_json: dict, tiny_model: Path, out: Path) -> Path:
    """`out` holding `config_json` as config.json beside the tiny model's tokenizer files (so that the
    architecture is the only problem)."""
    out.mkdir()
    for f in tiny_model.glob("tokenizer*"):
        shutil.copy(f, out / f.name)
    (out / "config.json").write_text(json.dumps(config_json))
    return out


@pytest.mark.parametrize("hf_config", [NEMOTRON_H, QWEN3_5, QWEN2_RM], ids=lambda c: c["architectures"][0])
def test_an_architecture_megarl_does_not_map_is_named_with_its_config_and_the_supported_ones(hf_config, tiny_assets,
                                                                                             tmp_path):
    model = model_dir_with(hf_config, tiny_assets / "model", tmp_path / "model")
    text = _problems(_config(model, tiny_assets / "data/train.parquet"))
    architecture = hf_config["architectures"][0]
    named = f"actor_rollout_ref.model.path='{model}': {model}/config.json: architecture {architecture} " \
            f"(`model_type`='{hf_config['model_type']}')"
    if hf_config is QWEN3_5:  # refused by name, with what blocks it (tests/bridge/test_config.py)
        assert f"{named}: its gated delta net (linear attention) layers are not supported" in text
    else:
        assert f"{named} is not supported: megarl maps these HF architectures onto megatron-core: {SUPPORTED}" in text
    assert text.count("\n  - ") == 1  # the only problem
    # the reward model's path is checked the same way
    rm = _problems(_config(tiny_assets / "model", tiny_assets / "data/train.parquet", "reward_model.enable=true",
                           f"reward_model.model.path={model}"))
    assert f"reward_model.model.path='{model}': {model}/config.json: architecture {architecture}" in rm


def test_gpu_count_on_one_node():
    """Pure rule: on one CUDA node the run needs trainer.n_gpus_per_node visible GPUs; on CPU the GPUs
    are Ray's logical ones; several nodes are checked by `megarl check-cluster`."""
    config = load_and_validate(None, ["actor_rollout_ref.model.path=/m", "data.train_files=/d.parquet"])
    assert "trainer.n_gpus_per_node=8, but this machine shows 2 CUDA GPU(s)" in gpu_count_problem(config, True, 2)
    assert gpu_count_problem(config, True, 8) is None
    assert gpu_count_problem(config, False, 0) is None


def _fake_hub_cache(hf_home: Path, repo_id: str, model_dir: Path) -> Path:
    """The HF cache layout huggingface_hub reads offline: hub/models--org--name/{refs/main,snapshots/<sha>/}."""
    sha = "0123456789abcdef0123456789abcdef01234567"
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    shutil.copytree(model_dir, repo / "snapshots" / sha)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)
    return repo / "snapshots" / sha


def test_a_hub_id_resolves_through_the_hf_cache_for_the_dry_run_and_plan(tiny_assets, tmp_path, monkeypatch, capsys):
    snapshot = _fake_hub_cache(tmp_path / "hf", "tiny-org/tiny-qwen2", tiny_assets / "model")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    args = [*CPU, "actor_rollout_ref.model.path=tiny-org/tiny-qwen2", f"data.train_files={tiny_assets}/data/train.parquet"]
    r = subprocess.run([sys.executable, "-m", "megarl.trainer.main_ppo", *args, "--dry-run"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "dry run OK" in r.stdout

    # in this process: huggingface_hub read HF_HOME at import, so point its cache constant at the fake hub
    import huggingface_hub.constants

    from megarl.bridge import ConversionError
    from megarl.bridge.hub import local_model_dir
    from megarl.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    # the run gets the config with the cached snapshot's directory in place of the id
    config = check_environment(load_and_validate(None, args))
    assert config.actor_rollout_ref.model.path == str(snapshot)
    main(["plan", *args])
    out = capsys.readouterr().out
    assert "memory estimate skipped" not in out and "parameters" in out, out
    with pytest.raises(ConversionError, match="'tiny-org/absent': HF_HUB_OFFLINE=1 and it is not in the HF cache"):
        local_model_dir("tiny-org/absent", "actor_rollout_ref.model.path")
    # online, but the hub does not answer (a compute node without internet): the same kind of message
    from megarl.net import free_port

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{free_port('127.0.0.1')}")
    with pytest.raises(ConversionError, match="'tiny-org/absent': the Hugging Face hub cannot be reached from here "
                                              "and it is not in the HF cache"):
        local_model_dir("tiny-org/absent", "actor_rollout_ref.model.path")


def test_an_expert_parallel_rl_actor_passes_the_checks_and_a_tensor_parallel_moe_actor_does_not(tiny_assets, tmp_path):
    """The resharder gathers experts across EP ranks (tests/sync/test_expert_sync.py): an RL actor
    with expert_model_parallel_size=2 is no longer refused before the run. An MoE actor at TP 2 is
    without sequence parallelism, and passes with it (a dense one passes either way)."""
    from megarl.data.tiny_model import make_tiny_model

    moe = make_tiny_model("qwen3_moe", tmp_path / "moe", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=32)
    train = tiny_assets / "data/train.parquet"
    config = check_environment(_config(moe, train, "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2"))
    assert config.actor_rollout_ref.actor.megatron.expert_model_parallel_size == 2
    # TP 2: megatron-core trains MoE layers with TP > 1 only with sequence parallelism
    tp2 = _problems(_config(moe, train, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"))
    assert "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2: the model is a mixture of experts" in tp2
    assert "set actor_rollout_ref.actor.megatron.sequence_parallel=true" in tp2
    check_environment(_config(moe, train, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                              "actor_rollout_ref.actor.megatron.sequence_parallel=true"))
    check_environment(_config(tiny_assets / "model", train, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"))


def test_a_transformer_override_that_megatron_core_does_not_know_is_named_before_anything_starts(tiny_assets):
    key = "actor_rollout_ref.actor.megatron.override_transformer_config"
    config = _config(tiny_assets / "model", tiny_assets / "data/train.parquet", f"+{key}.recompute_granularity=full",
                     f"+{key}.recompute_method=uniform", f"+{key}.recompute_num_layers=1", f"+{key}.recompute_layers=2")
    text = _problems(config)
    assert f"{key}.recompute_layers: not a field of megatron-core's TransformerConfig" in text
    assert "recompute_granularity" not in text and "recompute_method" not in text


def test_a_rollout_ep_the_model_cannot_take_is_named_before_any_server_starts(tiny_assets, tmp_path):
    """SGLang gives each EP rank num_experts / ep_size experts and asserts the division as the server
    builds the model (fused_moe_triton/layer.py): 8 experts over EP 3 (TP 6) is named by --dry-run's
    checks, as is EP 2 for a dense model; EP 2 of the 8 experts is not."""
    from megarl.data.tiny_model import make_tiny_model

    moe = make_tiny_model("qwen3_moe", tmp_path / "moe", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=32)
    sglang = [f"data.train_files={tiny_assets / 'data/train.parquet'}", "trainer.n_gpus_per_node=6",
              "data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=6",
              "actor_rollout_ref.rollout.tensor_model_parallel_size=6"]
    key = "actor_rollout_ref.rollout.expert_parallel_size"
    three = _problems(load_and_validate(None, [*sglang, f"actor_rollout_ref.model.path={moe}", f"{key}=3"]))
    assert f"{key}=3 must divide the model's 8 routed experts per layer" in three
    dense = _problems(load_and_validate(None, [*sglang, f"actor_rollout_ref.model.path={tiny_assets / 'model'}",
                                               f"{key}=2"]))
    assert f"{key}=2: the model is not a mixture of experts, so there are no experts to split; set 1" in dense
    from megarl.trainer.inputs import rollout_expert_split_problem

    two = load_and_validate(None, [*sglang, f"actor_rollout_ref.model.path={moe}", f"{key}=2"])
    assert rollout_expert_split_problem(two) is None


def test_real_sglang_is_refused_a_tied_qwen3_moe_and_on_a_cpu_a_moe_it_cannot_serve(tiny_assets, tmp_path):
    """SGLang 0.5.23's Qwen3MoeForCausalLM never ties its output layer (docs/sglang-on-cpu.md): a run
    with rollout.name=sglang refuses a tied qwen3_moe before any server starts; on a CPU it refuses a
    mixture-of-experts family SGLang cannot serve there (qwen2_moe: a Triton kernel) and lets it serve
    the measured ones (an untied mixtral: tests/sglang/test_moe_on_cpu.py)."""
    from megarl.data.tiny_model import make_tiny_model

    moe = make_tiny_model("qwen3_moe", tmp_path / "moe")  # tied, as the tiny models are by default
    untied = make_tiny_model("qwen3_moe", tmp_path / "untied", tie=False)
    qwen2_moe = make_tiny_model("qwen2_moe", tmp_path / "qwen2_moe", tie=False)
    mixtral = make_tiny_model("mixtral", tmp_path / "mixtral", tie=False)
    sglang = ["actor_rollout_ref.rollout.name=sglang"]
    train = tiny_assets / "data/train.parquet"
    assert "SGLang 0.5.23's srt/models/qwen3_moe.py never ties its output layer" in _problems(
        _config(moe, train, *sglang))
    assert "with a qwen2_moe model: SGLang 0.5.23 cannot serve it there" in _problems(_config(qwen2_moe, train, *sglang))
    for served in (untied, mixtral, tiny_assets / "model"):  # only: no sglang in this interpreter
        problems = _problems(_config(served, train, *sglang))
        assert "SGLang 0.5.23" not in problems and "sglang is not installed here" in problems
    check_environment(_config(moe, train))  # the CPU engine serves it


def test_data_with_images_or_videos_is_refused_naming_the_first_row(tiny_assets, tmp_path):
    """verl's multimodal rows (data.image_key / data.video_key, its RLHFDataset's `images` / `videos`)
    would lose their images in megarl's text-only models: refused before any process starts, naming
    file, row and column; an empty column, or one under another name, is fine."""
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pd.read_parquet(tiny_assets / "data/train.parquet").head(8)
    with_images = tmp_path / "vl.parquet"
    images = [None, [], None, [{"bytes": b"\x89PNG"}], None, None, None, None]
    table = pa.Table.from_pandas(rows.assign(images=images), preserve_index=False)
    pq.write_table(table, with_images, row_group_size=2)  # the image in the second row group, at its row 1
    problems = _problems(_config(tiny_assets / "model", with_images))
    assert f"data.train_files: {with_images}: row 3: column 'images' (data.image_key) holds images or videos" in problems
    empty = tmp_path / "empty.parquet"
    rows.assign(videos=[None] * 8, pictures=[[b"x"]] * 8).to_parquet(empty)
    check_environment(_config(tiny_assets / "model", empty))  # no image in 'images' / 'videos'
    assert "column 'pictures' (data.image_key)" in _problems(_config(tiny_assets / "model", empty,
                                                                     "data.image_key=pictures"))
