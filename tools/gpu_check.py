"""GPU check of the megatron engine: HF equivalence, step time and model FLOPs utilisation.

One process, one GPU (world size 1, TP=1, PP=1), its world made as production makes a training
world (check 6); nothing is downloaded: the models are built here from configs with random
weights. Run on a machine with an NVIDIA GPU, megatron-core, transformers (and
transformer-engine, if installed) importable; Ray is not needed, SGLang only for check 5:

    PYTHONPATH=src python tools/gpu_check.py            # a few minutes on one H200

Checks, each reported with its figures and PASS/FAIL (the exit status is 1 if any failed):
  1. tiny Qwen2 (qkv bias, tied embeddings), float32, padded sequences: engine log-probs and
     entropies vs HF transformers (TF32 off).
  2. a ~1B-parameter Llama in bfloat16: engine log-probs for the padded and (with
     transformer-engine) the packed layout vs HF float32, within twice HF bf16's own error; the
     logits are made peaked (init std 0.05) so that a wrong weight mapping would show. At std 0.05
     this model amplifies rounding: on CPU, HF bf16 itself is off HF fp32 by 0.24 on average (max
     1.0) and the engine by 0.30 (max 1.3), which is why HF bf16 is no exact reference.
     (tests/engines/test_bf16.py checks the same bound on CPU at HF's default init.)
  3. the same model: `update_policy` step time, tokens/s and model FLOPs utilisation per
     layout, `compute_log_prob` throughput, and the step-0 invariant (the first update's ppo_kl
     is exactly 0 when the old log-probs come from the same weights).
  4. offload / onload of parameters, gradients and optimizer state: bytes, seconds, GB/s, and
     log-probs after onload bit-identical to before.
  5. colocated weight push through the tensor transport (TP 1): the tiny Qwen2 actor changed by
     an update, megarl's engine server on the same machine, `WeightSync` with transport=tensor
     inside a begin/end_weight_update session; the server's greedy log-probs equal the actor's
     recomputed ones after the push (and differed before), and the push's bucket copies are
     released after it (device memory allocated before == after, on CPU no shared-memory file
     left). On GPU the payload is SGLang's flattened bucket of CUDA IPC handles, so SGLang must be
     installed (`pip install -e '.[gpu]'`): without it this check fails, saying so. The bucket goes
     through the same per-TP-rank relay as on more GPUs (`sync/ipc_copies.py`), with one rank.
Checks 6-8 (tools/gpu_check_colocated.py) follow the colocated path as production runs it:
  6. production's world: it was made before check 1 (checks 1-5 run on it too) as
     `workers/base.py::RankedWorker` makes a rank's world (a TCPStore hosted by rank 0, `torch.cuda.set_device` first, the collective
     timeout `actor_rollout_ref.nccl_timeout`), with the backend and environment
     `config/devices.py` gives a colocated GPU run ("cpu:gloo,cuda:nccl"; `nccl_watchdog_env`, set
     before the world). Checked: the environment, each device's backend (ProcessGroupNCCL for
     CUDA, ProcessGroupGloo for CPU) and its timeout; a CUDA all-reduce (NCCL), a CPU all-reduce,
     `all_gather_object` and a barrier (gloo: torch sends object collectives over the CPU backend
     when it has one, distributed_c10d._get_object_coll_device); megatron's groups report the
     world's backend and gloo for the DP gloo group (`engines/megatron/parallel.py::group_backends`).
     --cpu: gloo only.
  7. a bucket's CUDA IPC handle across CUDA_VISIBLE_DEVICES spellings: a sender process (spawn)
     sees the GPU as CUDA_VISIBLE_DEVICES=<index> and makes the tensor transport's payload
     (`sync/ipc_copies.py`: `fresh_copy`, `serialise_copy`); a receiver that sees the same GPU as
     CUDA_VISIBLE_DEVICES=GPU-<uuid> opens it with the CPU engine server's decoder
     (`rollout/tensor_payload.py`, which mirrors SGLang's), and the other way round; its tensors
     must equal the sender's, on the same GPU. Production's payload (SGLang's flattened bucket, its
     reductions naming GPUs by UUID) needs SGLang; without it the sender uses megarl's own
     serialisation of the same views with torch's stock CUDA reduction, and says so. --cpu: the
     shared-memory path with the same two processes (the spellings are GPU only).
  8. release -> push -> resume against the memory ledger: the ~1B model (configured colocated,
     offloading all its states) trains one update, then follows `placement/colocated_memory.py`'s
     moves: grads + optimizer offloaded, `engine.empty_cache()`, the server's weights resumed
     (simulated: total_params x 2 bytes / rollout TP allocated here), a bucket of
     `update_weights_bucket_megabytes`, the bucket dropped, the parameters offloaded, the cache
     emptied, the KV cache resumed (the rest of the rollout pool). Each step prints the ledger's
     resident bytes (`placement/memory.py::estimate`: the actor's states and their parts, the
     server weights, the pool, the phases) beside torch.cuda.mem_get_info() (free, total),
     memory_allocated() and memory_reserved(), and the offloads their bytes per part. PASS: each
     step's device use (total - free, less the use before the engine was built; after the update,
     the allocated bytes, since the cache still holds its activations) is within 256 MiB + 1% of
     the ledger's figure, and each resume follows an emptied cache (reserved <= allocated + 128
     MiB). The 1% covers what the estimate leaves out (megatron's buffer padding, small tensors);
     the 256 MiB covers device memory outside any ledger: kernels loaded lazily since the baseline
     (CUDA module lazy loading), cuBLAS workspaces, megatron's small buffers, and allocator
     segments a live small tensor keeps (torch's caching allocator returns only wholly free
     segments: 2 MiB ones for blocks up to 1 MiB, 20 MiB ones up to 10 MiB, larger blocks their
     own), which is also what the 128 MiB of the cache test allows. The server's own CUDA context (a few hundred MiB per process in
     production) and its CUDA graphs are not simulated. A measurement: the figures are printed
     even when it fails. --cpu: the same moves with every device figure 0 (not compared).

Check 9 (tools/gpu_check_thd.py): transformer-engine's THD decision on megarl's packed micro-batch of one
  5-token sample at CP=2 (cu_seqlens [0, 5], padded [0, 8], plus the filler sequence): TE's rule for
  pad_between_seqs says True on the cu_seqlens megarl passes, and with TE on the GPU its DotProductAttention
  (THD, CP 1) on them equals a plain causal attention on the real rows. --cpu, or without TE: the
  decision only, TE's run reported as skipped and why.

`--cpu` runs the same code on a machine without a GPU (gloo, float32, small sizes) to check the
script itself; its figures mean nothing (`--cpu --dtype bfloat16` checks the bf16 path).
"""
from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from gpu_check_colocated import check_ipc_spellings, check_memory_ledger, check_production_world
from gpu_check_thd import check_thd_decision
from sglang_smoke import greedy_vs_actor

H200_BF16_DENSE_TFLOPS = 989.0  # also H100 SXM; dense bf16, no sparsity


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="check the script without a GPU (tiny sizes, no real figures)")
    p.add_argument("--batch", type=int, default=16, help="sequences per update (one mini-batch)")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=768)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--steps", type=int, default=5, help="timed updates (after 2 warm-up updates)")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS, help="GPU peak for MFU")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="of the ~1B model's check (default bfloat16; float32 with --cpu)")
    return p.parse_args()


# ------------------------------------------------------------------------------------------ set-up
def init_single_process(cpu: bool) -> dict:
    """The world of one training rank, made as production makes it: `devices_from_config` gives
    the backend and the workers' environment (`EngineGroup` starts them with
    `Devices.training_env`, so it is set before anything else), then `RankedWorker`'s
    master_address and init_process_group (rank 0 of 1): a TCPStore hosted here, the GPU selected
    before the world (cuda:0: no Ray GPU ids here), the collective timeout
    actor_rollout_ref.nccl_timeout (seconds). Returns what was done, for check 6."""
    from megarl.config import load_config
    from megarl.config.devices import devices_from_config

    config = load_config(None, [f"trainer.device={'cpu' if cpu else 'cuda'}"])
    devices = devices_from_config(config, cuda_available=not cpu)
    os.environ.update(devices.training_env)
    timeout_s = config.actor_rollout_ref.nccl_timeout
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    if "nccl" in devices.training_backend:
        torch.cuda.set_device(0)
    dist.init_process_group(devices.training_backend, store=store, rank=0, world_size=1,
                            timeout=timedelta(seconds=timeout_s))
    return {"backend": devices.training_backend, "env": devices.training_env, "collective_timeout_s": timeout_s,
            "store": store}


def experiment_config(model_dir: Path, dtype: str, batch: int, micro: int, temperature: float = 1.0):
    from megarl.config import load_config

    return load_config(None, [
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.model.dtype={dtype}",
        "trainer.n_gpus_per_node=1",
        f"data.train_batch_size={batch}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.rollout.temperature={temperature}",
        "actor_rollout_ref.actor.optim.lr=1e-6",
    ])


def random_batch(size: int, prompt_len: int, response_len: int, vocab: int, ragged: bool, seed: int = 0):
    """Token batch; ragged: lengths drawn in [len/2, len], else exactly the given lengths."""
    from megarl.data.batch import Batch

    g = torch.Generator().manual_seed(seed)

    def draw(length):
        n = int(torch.randint(max(1, length // 2), length + 1, (1,), generator=g)) if ragged else length
        return torch.randint(4, vocab, (n,), generator=g).tolist()

    batch = Batch.from_token_lists([draw(prompt_len) for _ in range(size)], [draw(response_len) for _ in range(size)])
    batch["advantages"] = torch.randn(size, 1, generator=g) * batch["response_mask"]
    return batch


def hf_log_probs(model, batch, temperature: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """HF log-probs and entropies [B, R] (float32, from the model-dtype logits / temperature)."""
    shape = batch["response_mask"].shape
    log_probs, entropy = torch.zeros(shape), torch.zeros(shape)
    for i in range(len(batch)):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()]
        response = batch["response_ids"][i][batch["response_mask"][i].bool()]
        ids = torch.cat([prompt, response])[None].to(device)
        with torch.no_grad():
            logp = (model(ids).logits[0].float() / temperature).log_softmax(-1)
        at = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(response), device=device)
        log_probs[i, : len(response)] = logp[at, response.to(device)].cpu()
        entropy[i, : len(response)] = (-(logp[at].exp() * logp[at]).sum(-1)).cpu()
    return log_probs, entropy


def difference(ours: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> dict:
    diff = (ours - reference)[mask].abs()
    return {"max_abs": diff.max().item(), "mean_abs": diff.mean().item(),
            "max_rel": (diff / reference[mask].abs().clamp(min=1e-6)).max().item(),
            "reference_std": reference[mask].std().item()}


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------ FLOPs
def train_flops(arch, prompt_lens: list[int], response_lens: list[int], forward_only: bool = False) -> float:
    """Model FLOPs of one pass over the sequences (matmuls and attention; fwd+bwd = 3x fwd).

    Per token: 2 x the backbone's matmul parameters; per response token: 2 x the output layer
    (the engine applies the head only where a log-prob is needed); attention: QK^T and AV,
    4 x (heads x head_dim) x context per token per layer, causal context = position + 1."""
    h, d_attn = arch.hidden_size, arch.num_attention_heads * arch.kv_channels
    d_kv = arch.num_query_groups * arch.kv_channels
    per_layer = h * d_attn + 2 * h * d_kv + d_attn * h + 3 * h * arch.ffn_hidden_size
    forward = 0.0
    for p, r in zip(prompt_lens, response_lens):
        n = p + r
        forward += 2 * arch.num_layers * per_layer * n
        forward += 2 * arch.vocab_size * h * r
        forward += 4 * arch.num_layers * d_attn * n * (n + 1) / 2
    return forward if forward_only else 3 * forward


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------ checks
def check_tiny_fp32(workdir: Path, cpu: bool) -> dict:
    from transformers import AutoModelForCausalLM

    from megarl.data.tiny_model import make_tiny_model
    from megarl.engines.megatron.roles import ActorEngine

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model_dir = make_tiny_model("qwen2", workdir / "tiny", layers=2, hidden=128, heads=4, kv_heads=2)
    batch = random_batch(8, 12, 20, vocab=47, ragged=True)
    engine = ActorEngine(experiment_config(model_dir, "float32", 8, 4, temperature=0.7), sequence_layout="padded")
    ours = engine.compute_log_prob(batch, 0.7, with_entropy=True)
    device = engine.device
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    ref_lp, ref_ent = hf_log_probs(hf, batch, 0.7, device)
    mask = batch["response_mask"].bool()
    result = {"log_probs": difference(ours["log_probs"], ref_lp, mask),
              "entropy": difference(ours["entropy"], ref_ent, mask)}
    result["pass"] = result["log_probs"]["max_abs"] < 1e-3 and result["entropy"]["max_abs"] < 1e-3
    return result


def build_1b_model(workdir: Path, cpu: bool, dtype: str) -> Path:
    """A Llama of ~1.03B parameters (20 x 2048, GQA 16/4 heads, FFN 5632, vocab 32000, untied),
    random weights with std 0.05, saved as `dtype` safetensors."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    sizes = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=20, num_attention_heads=16,
                 num_key_value_heads=4, vocab_size=32000)
    if cpu:
        sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=300)
    config = LlamaConfig(**sizes, max_position_embeddings=4096, tie_word_embeddings=False, initializer_range=0.05)
    torch.manual_seed(0)
    with torch.device("cpu" if cpu else "cuda"):
        model = AutoModelForCausalLM.from_config(config)
    model = model.to(getattr(torch, dtype))
    out = workdir / "llama_1b"
    model.save_pretrained(out)
    return out


def check_1b(model_dir: Path, args) -> dict:
    from transformers import AutoModelForCausalLM

    from megarl.engines.megatron.model import transformer_engine_available
    from megarl.engines.megatron.roles import ActorEngine

    dtype = args.dtype
    t0 = time.perf_counter()
    engine = ActorEngine(experiment_config(model_dir, dtype, args.batch, args.micro_batch), sequence_layout="padded")
    synchronize()
    result = {"build_seconds": time.perf_counter() - t0,
              "parameters": sum(p.numel() for c in engine.model_chunks for p in c.parameters()),
              "transformer_engine": transformer_engine_available()}
    layouts = ["padded", "packed"] if transformer_engine_available() else ["padded"]
    vocab = engine.arch.vocab_size

    # equivalence on a ragged batch. bf16 kernels round differently, so the yardstick is HF itself:
    # both HF in `dtype` and the engine are compared with HF in float32 (TF32 off), and the engine
    # passes when its error is at most twice HF's own (plus a small floor).
    ragged = random_batch(8, args.prompt_len // 2, args.response_len // 4, vocab, ragged=True, seed=1)
    references = {}
    for ref_dtype in sorted({"float32", dtype}):
        torch.backends.cuda.matmul.allow_tf32 = False
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, ref_dtype)).to(engine.device).eval()
        references[ref_dtype], _ = hf_log_probs(hf, ragged, 1.0, engine.device)
        del hf
        release_memory()
    mask = ragged["response_mask"].bool()
    hf_error = difference(references[dtype], references["float32"], mask)
    result["hf_vs_hf_fp32"] = hf_error
    result["equivalence"] = {}
    for layout in layouts:
        engine.sequence_layout = layout
        ours = engine.compute_log_prob(ragged, 1.0)
        diff = difference(ours["log_probs"], references["float32"], mask)
        diff["pass"] = (diff["mean_abs"] <= 2 * hf_error["mean_abs"] + 1e-3
                        and diff["max_abs"] <= 2 * hf_error["max_abs"] + 1e-2)
        result["equivalence"][layout] = diff

    # timing: compute_log_prob and update_policy on fixed-length sequences
    batch = random_batch(args.batch, args.prompt_len, args.response_len, vocab, ragged=False, seed=2)
    p_lens = batch["prompt_mask"].sum(1).tolist()
    r_lens = batch["response_mask"].sum(1).tolist()
    tokens = sum(p_lens) + sum(r_lens)
    result["timing"] = {}
    for layout in layouts:
        engine.sequence_layout = layout
        synchronize()
        t = time.perf_counter()
        old = engine.compute_log_prob(batch, 1.0)
        synchronize()
        fwd_seconds = time.perf_counter() - t
        batch["old_log_probs"] = old["log_probs"]
        times, first_ppo_kl = [], None
        for step in range(2 + args.steps):
            synchronize()
            t = time.perf_counter()
            metrics = engine.update_policy(batch)
            synchronize()
            if step == 0:
                first_ppo_kl = metrics["actor/ppo_kl"]  # old log-probs from the same weights: exactly 0
            if step >= 2:
                times.append(time.perf_counter() - t)
        step_seconds = statistics.median(times)
        flops = train_flops(engine.arch, p_lens, r_lens)
        fwd_flops = train_flops(engine.arch, p_lens, r_lens, forward_only=True)
        result["timing"][layout] = {
            "update_seconds_median": step_seconds,
            "update_seconds_all": times,
            "tokens_per_update": tokens,
            "update_tokens_per_second": tokens / step_seconds,
            "update_tflops": flops / step_seconds / 1e12,
            "update_mfu": flops / step_seconds / 1e12 / args.peak_tflops,
            "log_prob_seconds": fwd_seconds,
            "log_prob_tokens_per_second": tokens / fwd_seconds,
            "log_prob_mfu_incl_first_call": fwd_flops / fwd_seconds / 1e12 / args.peak_tflops,
            "first_update_ppo_kl": first_ppo_kl,
            "last_grad_norm": metrics["actor/grad_norm"],
        }
    if torch.cuda.is_available():
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30

    # offload / onload
    before = engine.compute_log_prob(batch, 1.0)["log_probs"]
    allocated = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    off = engine.offload()
    after = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
    on = engine.onload()
    result["offload"] = {**off, "GBps": off["bytes"] / off["seconds"] / 1e9,
                         "device_memory_released_gib": (allocated - after) / 2**30}
    result["onload"] = {**on, "GBps": on["bytes"] / on["seconds"] / 1e9}
    result["onload_restores_log_probs"] = torch.equal(before, engine.compute_log_prob(batch, 1.0)["log_probs"])
    result["pass"] = (all(d["pass"] for d in result["equivalence"].values()) and result["onload_restores_log_probs"]
                      and all(t["first_update_ppo_kl"] == 0.0 for t in result["timing"].values()))
    return result


def check_tensor_push(workdir: Path, cpu: bool) -> dict:
    """Check 5: the actor (this process) pushes into megarl's engine server (a child process,
    stopped by PID) through /update_weights_from_tensor."""
    from megarl.data.tiny_model import make_tiny_model
    from megarl.engines.megatron.roles import ActorEngine
    from megarl.net import free_port
    from megarl.rollout.client import RolloutClient
    from megarl.rollout.control import ServerControl
    from megarl.rollout.launch import cpu_server_command
    from megarl.rollout.process import ServerProcess
    from megarl.sync import SyncConfig, WeightSync

    torch.backends.cuda.matmul.allow_tf32 = False
    model_dir = make_tiny_model("qwen2", workdir / "tiny-push", layers=2, hidden=128, heads=4, kv_heads=2, seed=5)
    engine = ActorEngine(experiment_config(model_dir, "float32", 4, 2), sequence_layout="padded")
    port = free_port("127.0.0.1")
    server = ServerProcess("gpu-check-engine-server", cpu_server_command(str(model_dir), port, num_threads=2),
                           f"http://127.0.0.1:{port}", log_path=str(workdir / "engine-server.log"),
                           startup_timeout_s=180)
    server.start()
    try:
        prompts = [[1, 10, 11, 12], [1, 20, 5, 30, 7], [1, 40, 41]]

        def difference_to_actor() -> float:
            with RolloutClient(server.url, max_retries=0) as client:
                gap, _, _, _ = greedy_vs_actor(client, engine, prompts, 6, lambda a, b: (a - b).abs().max().item())
            return gap

        result = {"same_weights_max_abs": difference_to_actor()}
        with torch.no_grad():  # an "update": seeded noise on every parameter
            g = torch.Generator().manual_seed(0)
            for chunk in engine.model_chunks:
                for param in chunk.parameters():
                    param.add_((torch.randn(param.shape, generator=g) * 0.05).to(param.device, param.dtype))
        result["before_push_max_abs"] = difference_to_actor()
        control = ServerControl(server.url)
        control.release_memory_when_idle()  # the colocated server's state during training, released as the fleet does
        control.resume_memory_occupation(["weights"])  # what the cluster does before a push (colocated_memory)
        sync = WeightSync(engine.model_chunks, engine.weight_map, [server.url],
                          SyncConfig(transport="tensor", bucket_bytes=64 * 1024, timeout_s=120))
        shm_before = _shared_memory_files()
        synchronize()
        allocated_before = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        during: set = set()  # the copies held while the stream runs (CPU: files in /dev/shm)
        metrics = sync.push(progress=lambda stage, bucket: during.update(_shared_memory_files() - shm_before),
                            flush=[False])  # its KV cache is released: no /flush_cache
        control.resume_memory_occupation(["kv_cache", "cuda_graph"])  # and after it, the KV cache
        synchronize()
        allocated_after = torch.cuda.memory_allocated() if torch.cuda.is_available() else 0
        result.update({k: metrics[k] for k in ("sync/seconds", "sync/bytes", "sync/gb_per_s", "sync/buckets")})
        result["device_allocated_before_after"] = (allocated_before, allocated_after)
        result["shared_memory_files_during_push"] = len(during)
        result["shared_memory_files_left"] = sorted(_shared_memory_files() - shm_before)
        result["server_weight_version"] = control.weight_version()
        result["after_push_max_abs"] = difference_to_actor()
        sync.close()
        result["pass"] = (result["after_push_max_abs"] < 1e-3 and result["before_push_max_abs"] > 1e-2
                          and allocated_after == allocated_before and not result["shared_memory_files_left"]
                          and (torch.cuda.is_available() or len(during) > 0)
                          and result["server_weight_version"] == "1")
        return result
    finally:
        server.stop(timeout_s=15)


def _shared_memory_files() -> set:
    """This process's torch shared-memory files (CPU tensors shared by file name)."""
    prefix = f"torch_{os.getpid()}_"
    return {f for f in os.listdir("/dev/shm") if f.startswith(prefix)} if os.path.isdir("/dev/shm") else set()


def report(name: str, run) -> bool:
    print(f"\n=== {name}", flush=True)
    t = time.perf_counter()
    try:
        result = run()
    except Exception:
        traceback.print_exc()
        print(f"--- {name}: FAIL (exception) after {time.perf_counter() - t:.1f} s", flush=True)
        return False
    finally:
        release_memory()
    for key, value in result.items():
        print(f"  {key}: {value}")
    ok = bool(result.get("pass", True))
    print(f"--- {name}: {'PASS' if ok else 'FAIL'} in {time.perf_counter() - t:.1f} s", flush=True)
    return ok


def main() -> int:
    args = parse_args()
    args.dtype = args.dtype or ("float32" if args.cpu else "bfloat16")
    if args.cpu:
        args.batch, args.prompt_len, args.response_len, args.micro_batch, args.steps = 4, 16, 24, 2, 1
    elif not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or pass --cpu to check the script itself", file=sys.stderr)
        return 2
    start = time.perf_counter()
    world = init_single_process(args.cpu)
    if torch.cuda.is_available():
        print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory(prefix="megarl-gpu-check-") as tmp:
        workdir = Path(tmp)
        ok = report("tiny qwen2 fp32 vs HF (padded)", lambda: check_tiny_fp32(workdir, args.cpu))
        model_dir = workdir / "llama_1b"
        ok &= report(f"build ~1B llama (random, {args.dtype})",
                     lambda: {"path": str(build_1b_model(workdir, args.cpu, args.dtype))})
        ok &= report("~1B llama: equivalence, step time, MFU, offload", lambda: check_1b(model_dir, args))
        ok &= report("colocated TP1 weight push through the tensor transport", lambda: check_tensor_push(workdir, args.cpu))
        # 6-8: tools/gpu_check_colocated.py
        ok &= report("production's world (--cpu: gloo only, no NCCL)" if args.cpu else
                     "production's world: cpu:gloo,cuda:nccl, NCCL watchdog env, megatron's groups",
                     lambda: check_production_world(world, args.cpu))
        ok &= report("IPC push between two processes (--cpu: shared memory; the CUDA_VISIBLE_DEVICES spellings "
                     "are GPU only)" if args.cpu else "IPC push across CUDA_VISIBLE_DEVICES spellings (index <-> UUID)",
                     lambda: check_ipc_spellings(args.cpu))
        ok &= report("release -> push -> resume against the memory ledger"
                     + (" (--cpu: device figures all 0, not compared)" if args.cpu else ""),
                     lambda: check_memory_ledger(model_dir, args))
        ok &= report("TE's THD decision on megarl's packed micro-batch (cu [0, 5], padded [0, 8], CP 2)",
                     lambda: check_thd_decision(args.cpu))
    dist.destroy_process_group()
    print(f"\n{'ALL PASS' if ok else 'SOME CHECKS FAILED'} in {time.perf_counter() - start:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
