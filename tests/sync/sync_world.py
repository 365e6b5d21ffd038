"""The body of the multi-process checks: one 4-rank gloo world with real megatron-core (CPU shims
on), reused for every check so that processes start and import megatron once.

`reshard_checks`: the resharder's HF tensors at several layouts, for comparison with the offline
conversion. `expert_checks`: the same for a tiny Qwen3-MoE with expert parallelism (and a copy with
two experts swapped, the negative control), then a checked distributed push of it at TP1/EP2 into a CPU-engine
server and the log-probs on both sides. `servers_story`: an actor update, syncs into CPU-engine servers (distributed, a failed
one and its retry, disk + colocated), and log-probs of the servers against the actor's.
"""
from __future__ import annotations

import os
import signal
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from megarl.bridge import (
    ParallelLayout,
    WeightMap,
    arch_from_hf_config,
    load_hf_config,
    shard_model,
    tp_split,
)
from megarl.bridge.mapping import EMBEDDING
from megarl.bridge.megatron_config import block_spec, gpt_model_kwargs, layer_spec, transformer_config_kwargs
from megarl.bridge.safetensors_io import HFCheckpointReader
from megarl.bridge.sharding import layer_index, shard_tp, shift_layer
from megarl.bridge.transforms import padded_vocab_size
from megarl.testing import init_gloo_model_parallel, reinit_model_parallel
from megarl.engines.megatron.groups import initialize_model_parallel, release_model_parallel
from megarl.sync import ParallelGroups, Resharder, SyncConfig, WeightSync, WeightSyncError
from megarl.sync.resharder import gathered_bytes, local_params, unwrap

# the resharder checks: models x layouts (4 ranks: DP 2, DP 2, DP 1, DP 1)
RESHARD_LAYOUTS = [(2, 1, 1), (1, 2, 2), (2, 2, 1), (4, 1, 1)]
RESHARD_MODELS = {
    # make_tiny_model kwargs; the chunks' dtype; wrapped in megatron DDP; the dtype sent (None: the parameters')
    "qwen2-tied-bias": (dict(arch="qwen2", tie=True), torch.float32, False, None),
    "llama-untied-ddp-to-bf16": (dict(arch="llama", tie=False), torch.float32, True, torch.bfloat16),
    "qwen3-qknorm-headdim-bf16": (dict(arch="qwen3", tie=False, head_dim=24, dtype="bfloat16"), torch.bfloat16,
                                  False, None),
}
RESHARD_DIVISIBLE_BY = 8  # vocab 47 -> 48 / 48 / 64 rows at TP 1 / 2 / 4: padding is always there to drop
RESHARD_BUCKET_BYTES = 48 * 1024  # several buckets per stage; fc1 (64 KiB gathered) gets a bucket of its own
# the expert checks: (tp, pp, ep, etp), etp 0 meaning etp = tp; the first is also the push's layout
EXPERT_LAYOUTS = [(1, 1, 2, 0), (2, 1, 2, 1), (2, 1, 2, 0), (1, 2, 2, 0)]
EXPERT_MODEL = dict(arch="qwen3_moe", layers=2, hidden=64, heads=4, kv_heads=2, intermediate=32, tie=False)
EXPERT_BUCKET_BYTES = 32 * 1024  # a layer's 8 experts gather to 192 KiB: several expert buckets per layer
# the memory check: a random Llama of ~64 MB at TP=2 x PP=2, buckets of 8 MiB (the embedding and output
# layer, 8.4 MB each, get buckets of their own), so a bucket dwarfs the process's noise
MEMORY_LAYOUT = (2, 2)
MEMORY_MODEL = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                    num_key_value_heads=2, vocab_size=4096)
MEMORY_BUCKET_BYTES = 8 * 2**20
# the servers story: TP=2 x PP=2, ~5 buckets per stage, so a server can die between two of them
STORY_LAYOUT = (2, 2)
STORY_BUCKET_BYTES = 64 * 1024


def _ps():
    from megatron.core import parallel_state

    return parallel_state


def weight_map(hf_dir: Path, tp: int, divisible_by: int) -> WeightMap:
    arch = arch_from_hf_config(load_hf_config(hf_dir))
    return WeightMap(arch, padded_vocab_size(arch.vocab_size, divisible_by, tp))


def build_chunks(weights: WeightMap, layout: ParallelLayout, dtype: torch.dtype) -> list:
    """This rank's `GPTModel` chunks, every parameter in `dtype` (norms too, as Float16Module casts them)."""
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(**transformer_config_kwargs(weights.arch, layout, dtype), use_cpu_initialization=True,
                               perform_initialization=False)
    pp_rank = _ps().get_pipeline_model_parallel_rank()
    spec, dense_spec = layer_spec(weights.arch), layer_spec(weights.arch, dense=True)  # dense first layers of an MoE
    return [
        GPTModel(config, block_spec(weights.arch, layout, pp_rank, v, spec, dense_spec),
                 **gpt_model_kwargs(weights.arch, weights.padded_vocab_size),
                 pre_process=layout.is_first(pp_rank, v), post_process=layout.is_last(pp_rank, v),
                 vp_stage=v if layout.vpp > 1 else None).to(dtype).eval()
        for v in range(layout.vpp)
    ]


def load_hf(chunks: list, weights: WeightMap, layout: ParallelLayout, hf_dir: Path) -> None:
    """Every rank loads its shards of the HF checkpoint (the bridge's pure sharding)."""
    with HFCheckpointReader(hf_dir) as reader:
        full = {name: weights.to_mcore(name, reader.read) for name in weights.mcore_names()}
    ps = _ps()
    shards = shard_model(weights, full, layout)
    for v, chunk in enumerate(chunks):
        sd = dict(chunk.state_dict())
        sd.update(shards[layout.key(ps.get_pipeline_model_parallel_rank(), v, ps.get_tensor_model_parallel_rank(),
                                    ps.get_expert_model_parallel_rank())])
        chunk.load_state_dict(sd, strict=True)


def perturb(chunks: list, weights: WeightMap, seed: int, scale: float = 0.05) -> None:
    """The same deterministic update on every rank: seeded noise on each *full* parameter, of
    which each rank adds its own TP shard (a tied output-layer copy gets the embedding's noise)."""
    ps = _ps()
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for chunk in chunks:
            model = unwrap(chunk)
            for local, param in model.named_parameters():
                layer = layer_index(local)
                if layer is not None:
                    local = shift_layer(local, model.decoder.layers[layer].layer_number - 1 - layer)
                name = weights.canonical(local)  # an MoE layer's pre_mlp_layernorm stays itself
                key = EMBEDDING if weights.is_tied_output_copy(name) else name
                gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{key}".encode()))
                noise = torch.randn(weights.mcore_shape(key), generator=gen) * scale
                param.add_(shard_tp(tp_split(name), noise, tp, tp_rank).to(param.dtype))


# ------------------------------------------------------------------------------------------ resharder
def reshard_checks(rank: int, cases: dict, layouts: list, bucket_bytes: int) -> dict:
    """{(case, layout): what this rank's resharder produced}."""
    out = {}
    for tp, pp, vpp in layouts:
        layout = ParallelLayout(tp, pp, vpp)
        reinit_model_parallel(tp, pp, vpp if vpp > 1 else None)
        for name, case in cases.items():
            weights = weight_map(case["hf_dir"], tp, case["divisible_by"])
            chunks = build_chunks(weights, layout, case["dtype"])
            load_hf(chunks, weights, layout, case["hf_dir"])
            if case.get("ddp"):
                chunks = wrap_ddp(chunks)
            run = run_resharder(chunks, weights, bucket_bytes, case.get("wire_dtype"))
            out[(name, str(layout))] = dict(
                run, rank=rank,
                largest_param_bytes=max(gathered_bytes(p, tp) for p in local_params(chunks, weights, tp)),
            )
    return out


def memory_check(rank: int, out_dir: str) -> dict:
    """Peak extra resident memory (`tracking.memory`: the kernel's high-water mark) of two disk
    pushes of a random Llama (MEMORY_MODEL) at MEMORY_LAYOUT, each the resharder's pass and
    `DiskTransport.send` of every bucket, on every rank (`first`, `warm`: the first one also forms
    the new groups' connections); and the bucket size it is measured against."""
    from megarl.sync.transports import DiskTransport
    from megarl.tracking.memory import resident_peak

    tp, pp = MEMORY_LAYOUT
    reinit_model_parallel(tp, pp)
    config = dict(MEMORY_MODEL, model_type="llama", architectures=["LlamaForCausalLM"], max_position_embeddings=256,
                  rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, hidden_act="silu")
    arch = arch_from_hf_config(config)
    weights = WeightMap(arch, padded_vocab_size(arch.vocab_size, 128, tp))
    chunks = build_chunks(weights, ParallelLayout(tp, pp), torch.float32)
    with torch.no_grad():
        for param in chunks[0].parameters():
            param.uniform_(-0.05, 0.05)
    groups = ParallelGroups.from_parallel_state()
    resharder = Resharder(chunks, weights, groups, MEMORY_BUCKET_BYTES)
    transport = DiskTransport([], groups.pp_rank, out_dir, out_dir, []) if groups.is_emitter else None
    def push():  # a function: no bucket (and its buffer) outlives the pass in a loop variable
        for bucket in resharder.buckets():
            transport.send(bucket)

    out = {}
    for name in ("first", "warm"):
        if transport is not None:
            transport.open_stream(f"memory-{rank}-{name}")
        dist.barrier()
        with resident_peak() as memory:
            push()
        out[name] = memory["extra"]
    largest = max(gathered_bytes(p, tp) for p in local_params(chunks, weights, tp))
    return dict(out, emitter=groups.is_emitter, bucket_bytes=max(MEMORY_BUCKET_BYTES, largest),
                buckets=resharder.timings.buckets, written=transport.bytes if transport else 0)


def expert_layout_of(t: tuple) -> ParallelLayout:
    tp, pp, ep, etp = t
    return ParallelLayout(tp=tp, pp=pp, ep=ep, etp=etp)


def reinit_experts(layout: ParallelLayout) -> None:
    """Switch megatron's parallel state to `layout`, expert parallelism included."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    release_model_parallel()
    initialize_model_parallel(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                              expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.expert_tp)
    model_parallel_cuda_manual_seed(1234)


def swap_local_experts(chunks: list) -> None:
    """Swap the weights of local experts 0 and 1 of the first layer of the first chunk (every rank)."""
    experts = unwrap(chunks[0]).decoder.layers[0].mlp.experts.local_experts
    with torch.no_grad():
        for a, b in zip(experts[0].parameters(), experts[1].parameters()):
            saved = a.clone()
            a.copy_(b)
            b.copy_(saved)


def run_resharder(chunks: list, weights: WeightMap, bucket_bytes: int, dtype=None) -> dict:
    """What this rank's resharder emits: HF tensors (copies), bucket numbers, its buffers and
    the largest bucket's HF bytes; its roles."""
    groups = ParallelGroups.from_parallel_state()
    resharder = Resharder(chunks, weights, groups, bucket_bytes, dtype)
    tensors, counts, largest = {}, [], 0
    for bucket in resharder.buckets():
        counts.append((bucket.index, bucket.count))
        largest = max(largest, bucket.nbytes)
        for hf_name, tensor in bucket.named_tensors():
            assert hf_name not in tensors, hf_name
            tensors[hf_name] = tensor.clone()
    return dict(dp_rank=groups.dp_rank, pp_rank=groups.pp_rank, ep_rank=groups.ep_rank, emitter=groups.is_emitter,
                emits_dense=groups.emits_dense, emits_experts=groups.emits_experts, tensors=tensors, buckets=counts,
                peak_buffer_bytes=resharder.timings.peak_buffer_bytes, largest_bucket=largest)


def expert_checks(rank: int, case: dict) -> dict:
    """{str(layout): this rank's resharder output} at EXPERT_LAYOUTS, the negative control, and
    the push story at the first layout."""
    from megarl.engines.megatron.cpu.shims import apply_cpu_shims

    hf_dir, out = Path(case["hf_dir"]), {}
    for t in EXPERT_LAYOUTS:
        layout = expert_layout_of(t)
        reinit_experts(layout)
        weights = weight_map(hf_dir, layout.tp, RESHARD_DIVISIBLE_BY)
        chunks = build_chunks(weights, layout, torch.float32)
        apply_cpu_shims()  # reach the MoE modules imported by the build
        load_hf(chunks, weights, layout, hf_dir)
        out[str(layout)] = run_resharder(chunks, weights, case["bucket_bytes"])
        if t == EXPERT_LAYOUTS[0]:
            swap_local_experts(chunks)
            out["swapped"] = run_resharder(chunks, weights, case["bucket_bytes"])
            swap_local_experts(chunks)
            out["push"] = expert_push(chunks, weights, case)
            out.update(grouped_checks(chunks, weights, layout, hf_dir, case["bucket_bytes"]))
    return out


class GroupedLinearNames(torch.nn.Module):
    """Holds the given parameters as `weight0`, `weight1`, ... (transformer-engine GroupedLinear's names)."""

    def __init__(self, params: list):
        super().__init__()
        for k, param in enumerate(params):
            self.register_parameter(f"weight{k}", param)


class GroupedExpertNames(torch.nn.Module):
    """Stands for megatron's TEGroupedMLP (`experts.linear_fc1.weight<k>`, `experts.linear_fc2.weight<k>`),
    holding a SequentialMLP's own parameter objects (tensors unchanged); `order` lists the local
    expert whose weights become `weight<k>`. Names only: it has no forward."""

    def __init__(self, sequential, order: list):
        super().__init__()
        self.linear_fc1 = GroupedLinearNames([sequential.local_experts[k].linear_fc1.weight for k in order])
        self.linear_fc2 = GroupedLinearNames([sequential.local_experts[k].linear_fc2.weight for k in order])


def regroup_experts(chunks: list, reverse: bool = False) -> list:
    """Give every MoE layer's experts the grouped-GEMM names (local experts in reverse order with
    `reverse`: a wrong expert index). Returns the SequentialMLPs, for `restore_experts`."""
    saved = []
    for chunk in chunks:
        for layer in unwrap(chunk).decoder.layers:
            sequential = layer.mlp.experts
            order = list(range(len(sequential.local_experts)))
            layer.mlp.experts = GroupedExpertNames(sequential, order[::-1] if reverse else order)
            saved.append(sequential)
    return saved


def restore_experts(chunks: list, saved: list) -> None:
    layers = [layer for chunk in chunks for layer in unwrap(chunk).decoder.layers]
    for layer, sequential in zip(layers, saved):
        layer.mlp.experts = sequential


def grouped_checks(chunks: list, weights: WeightMap, layout: ParallelLayout, hf_dir: Path, bucket_bytes: int) -> dict:
    """The same chunks with their experts under grouped-GEMM names: the resharder's HF tensors;
    with the experts in reverse order (negative control); and after zeroing every parameter and
    loading the HF checkpoint through the engine's loader (`load_hf_weights`) into those names."""
    from megarl.engines.megatron.model import load_hf_weights
    from megarl.engines.megatron.parallel import RoleLayout

    started, out = time.monotonic(), {}
    saved = regroup_experts(chunks, reverse=True)
    out["grouped_reversed"] = run_resharder(chunks, weights, bucket_bytes)
    restore_experts(chunks, saved)
    saved = regroup_experts(chunks)
    names = [name for chunk in chunks for name, _ in chunk.named_parameters()]
    out["grouped_names"] = [name for name in names if ".mlp.experts." in name]
    out["grouped"] = run_resharder(chunks, weights, bucket_bytes)
    with torch.no_grad():
        for chunk in chunks:
            for param in chunk.parameters():
                param.zero_()
    role = RoleLayout(layout.tp, layout.pp, layout.vpp, layout.ep, layout.etp or None)
    load_hf_weights(chunks, weights, role, hf_dir, value_head=False, seed=0)
    out["grouped_loaded"] = run_resharder(chunks, weights, bucket_bytes)
    restore_experts(chunks, saved)
    out["grouped_s"] = round(time.monotonic() - started, 2)
    return out


def expert_push(chunks: list, weights: WeightMap, case: dict) -> dict:
    """The server serves another checkpoint of the same MoE (other seed); a distributed push of the
    actor's weights (DP replica 0 the dense buckets, each EP rank of expert-DP replica 0 its own
    experts, in per-expert names: the default weight-update groups), checked tensor by tensor
    against the server's checksums; log-probs before and after, the names each rank sent and the
    groups the server was asked to join. Then a disk and a tensor push (no groups: every DP replica
    its share of the dense buckets), each after an update and checked the same way, and the
    log-probs after them; the chunks get the checkpoint back at the end."""
    vocab, urls = weights.arch.vocab_size, [case["url"]]
    out = {"before": compare(chunks, vocab, urls)}
    sent = []  # the HF names of every bucket this rank sent (the coordinator's held last one is not)
    with GroupJoins() as joins:
        sync = WeightSync(chunks, weights, urls, SyncConfig(
            transport="distributed", backend="gloo", bucket_bytes=case["bucket_bytes"], check_weights=True,
            timeout_s=60))
        out["metrics"] = sync.push(progress=lambda stage, bucket: sent.extend(s.name for s in bucket.slots))
    out["joins"] = all_joins(joins)
    out["after"] = compare(chunks, vocab, urls)
    out["sent"] = sent
    g = sync.groups
    out["roles"] = dict(emitter=g.is_emitter, dp_rank=g.dp_rank, gathers_experts=g.gathers_experts,
                        emits_experts=g.emits_experts)
    sync.close()
    # the other transports, each after an update, checked tensor by tensor likewise
    version = sync.version
    for seed, transport in ((21, "disk"), (22, "tensor")):
        perturb(chunks, weights, seed=seed)
        paths = dict(disk_dir=case["disk_dir"], hf_assets_dir=case["hf_dir"]) if transport == "disk" else {}
        other = WeightSync(chunks, weights, urls, SyncConfig(
            transport=transport, bucket_bytes=case["bucket_bytes"], check_weights=True, timeout_s=60, **paths),
            initial_version=version)
        out[transport] = other.push()
        version = other.version
        other.close()
    out["last"] = compare(chunks, vocab, urls)
    load_hf(chunks, weights, expert_layout_of(EXPERT_LAYOUTS[0]), Path(case["hf_dir"]))  # the checkpoint again
    return out


def wrap_ddp(chunks: list) -> list:
    """megatron DDP around each chunk: parameter names gain `module.`, storage moves to DDP's buffers."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    return [DistributedDataParallel(c.config, DistributedDataParallelConfig(), c, disable_bucketing=True)
            for c in chunks]


# ------------------------------------------------------------------------------------------ servers
PROMPTS = [[1, 10, 11, 12], [1, 20, 5, 30, 7], [1, 40, 41], [1, 15, 25, 35, 45, 9]]
RESPONSE_TOKENS = 6


def server_samples(url: str) -> list:
    """Greedy responses to PROMPTS with their log-probs (= log_softmax(logits), SGLang's T=0 rule)."""
    from megarl.rollout.client import RolloutClient
    from megarl.rollout.protocol import SamplingParams

    with RolloutClient(url, max_retries=0) as client:
        result = client.generate(
            PROMPTS, SamplingParams(max_new_tokens=RESPONSE_TOKENS, temperature=0.0, ignore_eos=True))
    return [(p, s[0].token_ids, s[0].logprobs, s[0].weight_version) for p, s in zip(PROMPTS, result.samples)]


def forward_logits(chunks: list, input_ids: torch.Tensor):
    """Full fp32 logits [b, s, Vp] on the last stage's TP rank 0 (gathered over TP), None elsewhere."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ps = _ps()
    b, s = input_ids.shape
    position_ids = torch.arange(s).unsqueeze(0).expand(b, -1)

    def step(data_iterator, model):
        output = model(input_ids=input_ids, position_ids=position_ids, attention_mask=None)
        return output, lambda out: (out.sum() * 0.0, {"logits": out.detach().clone()})

    with torch.no_grad():
        store = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iter([None]), model=chunks, num_microbatches=1, seq_length=s,
            micro_batch_size=b, forward_only=True,
        )
    if not ps.is_pipeline_last_stage():
        return None
    local = store[0]["logits"]
    parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    dist.all_gather(parts, local, group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1).float() if ps.get_tensor_model_parallel_rank() == 0 else None


def actor_logprobs(chunks: list, vocab: int, samples: list) -> list:
    """The actor's log-probs of each sample's response tokens (on every rank)."""
    width = max(len(p) + len(r) for p, r, _, _ in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)  # right padding: causal attention ignores it
    for row, (p, r, _, _) in enumerate(samples):
        ids[row, : len(p) + len(r)] = torch.tensor(p + r)
    logits = forward_logits(chunks, ids)
    mine = None
    if logits is not None:
        logp = torch.log_softmax(logits[..., :vocab], dim=-1)
        mine = [logp[row, len(p) - 1 : len(p) + len(r) - 1].gather(-1, torch.tensor(r)[:, None])[:, 0]
                for row, (p, r, _, _) in enumerate(samples)]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return next(x for x in everyone if x is not None)


def compare(chunks: list, vocab: int, urls: list) -> dict:
    """max |server log-prob - actor log-prob| over every server's greedy samples, and the servers'
    weight versions (all ranks call; rank 0 talks to the servers)."""
    box = [[server_samples(u) for u in urls] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    diffs, versions = [], []
    for samples in box[0]:
        actor = actor_logprobs(chunks, vocab, samples)
        diffs.append(max((torch.tensor(s[2]) - a).abs().max().item() for s, a in zip(samples, actor)))
        versions.append(sorted({s[3] for s in samples}))
    return {"max_diff": max(diffs), "versions": versions}


class GroupJoins:
    """Counts, on this rank, the `/init_weights_update_group` calls it makes: {server URL: [group
    names]} (a server joins a weight-update group through exactly one such call)."""

    def __enter__(self) -> dict:
        from megarl.sync.servers import SyncServer

        self.joins: dict = {}
        self.own = vars(SyncServer).get("init_weights_update_group")  # None: inherited from ServerControl
        original = SyncServer.init_weights_update_group

        def counted(server, *args, **kwargs):
            self.joins.setdefault(server.url, []).append(args[4] if len(args) > 4 else kwargs["group_name"])
            return original(server, *args, **kwargs)

        SyncServer.init_weights_update_group = counted
        return self.joins

    def __exit__(self, *exc) -> None:
        from megarl.sync.servers import SyncServer

        if self.own is None:
            del SyncServer.init_weights_update_group  # ServerControl's again
        else:
            SyncServer.init_weights_update_group = self.own


def all_joins(joins: dict) -> dict:
    """{server URL: sorted group names} joined from every rank of the world (collective)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, joins)
    out: dict = {}
    for rank_joins in everyone:
        for url, names in rank_joins.items():
            out.setdefault(url, []).extend(names)
    return {url: sorted(names) for url, names in out.items()}


def failed_push(sync: WeightSync, progress) -> tuple:
    """(the WeightSyncError's text or None, the version the sync holds after) of a push meant to fail."""
    try:
        sync.push(progress=progress)
        return None, sync.version
    except WeightSyncError as e:
        return str(e), sync.version


def servers_story(rank: int, case: dict) -> dict:
    from megarl.rollout.control import ServerControl

    tp, pp = case["layout"]
    layout = ParallelLayout(tp, pp)
    reinit_model_parallel(tp, pp)
    hf_dir, urls = Path(case["hf_dir"]), case["urls"]
    weights = weight_map(hf_dir, tp, 64)
    vocab = weights.arch.vocab_size
    chunks = build_chunks(weights, layout, torch.float32)
    load_hf(chunks, weights, layout, hf_dir)
    started = time.monotonic()
    out = {"seconds": {}}

    def lap(phase):
        out["seconds"][phase] = round(time.monotonic() - started, 1)

    lap("init")
    out["initial"] = compare(chunks, vocab, urls)  # same weights on both sides
    lap("initial compare")

    config = SyncConfig(transport="distributed", backend="gloo", bucket_bytes=case["bucket_bytes"], timeout_s=60)
    sync = WeightSync(chunks, weights, urls, config)
    perturb(chunks, weights, seed=1)
    out["before"] = compare(chunks, vocab, urls)
    out["metrics"] = sync.push()
    lap("push")
    out["after"] = compare(chunks, vocab, urls)
    lap("after compare")

    # a server dies after the coordinator's first bucket: the push fails, naming it
    perturb(chunks, weights, seed=2)

    def kill_second_server(stage, bucket):
        if stage == 0 and bucket.index == 0:
            os.killpg(case["pids"][1], signal.SIGKILL)

    out["failure"], out["version_after_failure"] = failed_push(sync, kill_second_server)
    lap("failed push")
    if rank == 0:
        out["survivor_version"] = ServerControl(urls[0]).weight_version()
        ServerControl(urls[1]).wait_healthy(300)  # restarted by the test's process monitor (a loaded machine takes minutes)
    lap("restart")
    out["retry_metrics"] = sync.push()
    lap("retry")
    out["retry"] = compare(chunks, vocab, urls)

    # a server restarts between two pushes (it serves the original weights again): the next push
    # notices from its version and forms new groups instead of failing
    if rank == 0:
        os.killpg(case["pids"][0], signal.SIGKILL)
        time.sleep(1.0)  # the monitor's restart takes longer than this
        ServerControl(urls[0]).wait_healthy(300)
    lap("second restart")
    perturb(chunks, weights, seed=3)
    out["after_restart_metrics"] = sync.push()
    out["after_restart"] = compare(chunks, vocab, urls)
    lap("push after restart")
    sync.close()

    # disk transport, colocated: the servers' memory was released for training; the caller (the
    # cluster) resumes their weights before the push and their KV cache after it
    perturb(chunks, weights, seed=4)
    if rank == 0:
        for url in urls:
            ServerControl(url).release_memory_when_idle()
            ServerControl(url).resume_memory_occupation(["weights"])
    disk = WeightSync(chunks, weights, urls, SyncConfig(
        transport="disk", bucket_bytes=case["bucket_bytes"], disk_dir=case["disk_dir"], hf_assets_dir=str(hf_dir),
        timeout_s=60), initial_version=sync.version)
    lap("before disk")
    out["disk_metrics"] = disk.push(flush=[False] * len(urls))  # their KV cache is released: no flush
    if rank == 0:
        for url in urls:
            ServerControl(url).resume_memory_occupation(["kv_cache", "cuda_graph"])
    lap("disk push")
    out["disk"] = compare(chunks, vocab, urls)
    out["disk_dirs"] = sorted(p.name for p in Path(case["disk_dir"]).iterdir())
    lap("disk compare")
    out["tensor"] = tensor_story(chunks, weights, vocab, case, disk.version, lap)
    load_hf(chunks, weights, layout, hf_dir)  # the actor holds the HF checkpoint again, the servers an update
    out["checked"] = checked_story(chunks, weights, case, out["tensor"]["version"], lap)
    out["split"] = split_story(case, out["checked"]["version"], lap)
    out["stage_groups"] = stage_groups_story(case, out["split"]["version"], lap)
    return out


def updated_actor(case: dict, tp: int, pp: int, seed: int) -> tuple[list, WeightMap]:
    """(chunks, weight map) of the HF checkpoint at TP x PP over the world (megatron's state made
    anew), then changed as an update would (`perturb` with `seed`)."""
    hf_dir = Path(case["hf_dir"])
    reinit_model_parallel(tp, pp)
    layout = ParallelLayout(tp, pp)
    weights = weight_map(hf_dir, tp, 64)
    chunks = build_chunks(weights, layout, torch.float32)
    load_hf(chunks, weights, layout, hf_dir)
    perturb(chunks, weights, seed=seed)
    return chunks, weights


def stage_groups_story(case: dict, version: int, lap) -> dict:
    """The default weight-update groups at TP 1 x PP 2 x DP 2 (4 ranks): an update pushed with the
    equality check on; the groups every server was asked to join, and which ranks sent buckets."""
    urls = case["urls"]
    chunks, weights = updated_actor(case, tp=1, pp=2, seed=10)
    sent = []
    with GroupJoins() as joins:
        sync = WeightSync(chunks, weights, urls, SyncConfig(transport="distributed", backend="gloo", timeout_s=60,
                                                           bucket_bytes=case["bucket_bytes"], check_weights=True),
                          initial_version=version)
        metrics = sync.push(progress=lambda stage, bucket: sent.append(bucket.index))
    lap("stage groups push")
    g = sync.groups
    out = dict(joins=all_joins(joins), metrics=metrics, version=sync.version, pp_rank=g.pp_rank, dp_rank=g.dp_rank,
               emitter=g.is_emitter, sent=sent)
    sync.close()
    return out


def split_story(case: dict, version: int, lap) -> dict:
    """DP replicas share the push (`weight_update_groups="per_emitter"`): TP 2 on 4 ranks (DP 2), an
    update pushed with the equality check on; each emitter records the buckets it sent (the
    coordinator also keeps the last one back), and the groups every server was asked to join."""
    urls = case["urls"]
    chunks, weights = updated_actor(case, tp=2, pp=1, seed=9)
    sent = []
    with GroupJoins() as joins:
        sync = WeightSync(chunks, weights, urls, SyncConfig(
            transport="distributed", backend="gloo", timeout_s=60, bucket_bytes=case["bucket_bytes"],
            check_weights=True, weight_update_groups="per_emitter"), initial_version=version)
        metrics = sync.push(progress=lambda stage, bucket: sent.append(bucket.index))
    lap("split push")
    g = sync.groups
    out = dict(dp_rank=g.dp_rank, emitter=g.is_emitter, coordinator=g.is_coordinator, sent=sent,
               count=len(sync.resharder.plan()), metrics=metrics, version=sync.version, joins=all_joins(joins))
    sync.close()
    return out


def server_checksums(urls: list) -> list:
    """Each server's {HF name: checksum} from /weights_checker (rank 0 asks; None elsewhere)."""
    from megarl.sync.servers import SyncServer

    return [SyncServer(u).weights_checksums()[0] for u in urls] if dist.get_rank() == 0 else None


def checked_story(chunks: list, weights: WeightMap, case: dict, version: int, lap) -> dict:
    """The equality check (`check_weights`) on distributed pushes: an update-free push of the HF
    checkpoint passes it (the servers' checksums, recorded before and after, are compared with HF's
    own save_pretrained by the test); a bucket corrupted on stage 1's emitter after it was hashed
    fails the push on every rank naming the tensor and both servers; the next push passes."""
    urls = case["urls"]
    out = {"before": server_checksums(urls)}
    sync = WeightSync(chunks, weights, urls, SyncConfig(transport="distributed", backend="gloo", timeout_s=60,
                                                       bucket_bytes=case["bucket_bytes"], check_weights=True),
                      initial_version=version)
    out["metrics"] = sync.push()
    out["after"] = server_checksums(urls)
    lap("checked push")

    perturb(chunks, weights, seed=8)
    out["corrupted"] = None
    if sync.groups.is_emitter and sync.groups.pp_rank == 1:  # after hashing, before the wire
        send = sync.transport.send

        def corrupt_first_bucket(bucket, *args, **kwargs):
            if bucket.index == 0:
                name, tensor = bucket.named_tensors()[0]
                tensor.view(-1)[0] += 1.0
                out["corrupted"] = name
            return send(bucket, *args, **kwargs)

        sync.transport.send = corrupt_first_bucket
    out["failure"], out["version_after_failure"] = failed_push(sync, None)
    lap("corrupted push")
    if sync.transport is not None:
        vars(sync.transport).pop("send", None)  # the transport's own send again
    out["retry_metrics"] = sync.push()
    out["version"] = sync.version
    lap("checked retry")
    sync.close()
    return out


def tensor_story(chunks: list, weights: WeightMap, vocab: int, case: dict, version: int, lap) -> dict:
    """The tensor transport, colocated: two pushes through /update_weights_from_tensor (each
    after an update), each bucket's copy dropped once the servers answered for it (`CopyTracker`:
    the most copy bytes alive at once; the held copies at each bucket sent) and their shared-memory
    files gone after; then a server that refuses a bucket mid-push (its session closed under it)
    fails the push naming it, and the retry completes."""
    from copy_tracker import CopyTracker
    from megarl.rollout.control import ServerControl

    tracker = CopyTracker().install()

    urls = case["urls"]
    out = {"pushes": []}
    sync = WeightSync(chunks, weights, urls, SyncConfig(transport="tensor", bucket_bytes=case["bucket_bytes"],
                                                       timeout_s=60), initial_version=version)
    for seed in (5, 6):
        perturb(chunks, weights, seed=seed)
        before = compare(chunks, vocab, urls) if seed == 5 else None  # the servers are behind the update
        if dist.get_rank() == 0:  # training: the colocated servers released their memory; weights back for the push
            for url in urls:
                ServerControl(url).release_memory_when_idle()
                ServerControl(url).resume_memory_occupation(["weights"])
        seen = {"in_flight": []}
        tracker.reset()

        def watch(stage, bucket):
            seen["in_flight"].append(len(sync.transport.in_flight))

        metrics = sync.push(progress=watch, flush=[False] * len(urls))  # KV caches released: no flush
        if dist.get_rank() == 0:
            for url in urls:
                ServerControl(url).resume_memory_occupation(["kv_cache", "cuda_graph"])
        import gc

        gc.collect()
        out["pushes"].append(dict(
            before=before, after=compare(chunks, vocab, urls), metrics=metrics, in_flight=seen["in_flight"],
            alive_after=sum(r() is not None for r in tracker.made), copies=tracker.copies, copied=tracker.copied,
            peak_copy_bytes=tracker.peak_bytes, largest_copy_bytes=tracker.largest, files=len(tracker.files),
            files_after=sorted(f for f in tracker.files if os.path.exists(f)),
            held_after=None if sync.transport is None else len(sync.transport.in_flight)))
        lap(f"tensor push {seed}")

    # a server refuses a bucket: its update session is closed under the push
    perturb(chunks, weights, seed=7)

    def close_session(stage, bucket):
        if stage == 0 and bucket.index == 0:
            ServerControl(urls[1]).end_weight_update()

    out["failure"], out["version_after_failure"] = failed_push(sync, close_session)
    lap("tensor failed push")
    out["retry_metrics"] = sync.push()
    out["retry"] = compare(chunks, vocab, urls)
    out["version"] = sync.version
    lap("tensor retry")
    sync.close()
    return out


def world(rank: int, world_size: int, port: int, reshard: dict, servers: dict, experts: dict, memory_dir: str) -> dict:
    from megarl.engines.megatron.cpu.moe_shims import apply_moe_cpu_shims

    init_gloo_model_parallel(rank, world_size, port, timeout_s=300)
    apply_moe_cpu_shims()
    started = time.monotonic()
    out = {"reshard": reshard_checks(rank, **reshard)}
    out["reshard_s"] = round(time.monotonic() - started, 1)
    out["experts"] = expert_checks(rank, experts)
    out["experts_s"] = round(time.monotonic() - started - out["reshard_s"], 1)
    out["servers"] = servers_story(rank, servers)
    out["memory"] = memory_check(rank, memory_dir)
    return out
