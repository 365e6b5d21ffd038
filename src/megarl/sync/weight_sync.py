"""`WeightSync`: push the actor's current weights into the rollout servers, verified and measured.

    sync = WeightSync(engine.model_chunks, engine.weight_map, server_urls, SyncConfig(...))  # every actor rank
    metrics = sync.push()                                                                  # every actor rank, per step

What runs where (roles in `groups.py`; process groups read from megatron's `parallel_state`
unless `groups` is given; the world group is torch.distributed's default group, the actor's):

1. prepare, coordinator only: every server answers its weight version (`/model_info`, the liveness
   probe) and is drained (`/flush_cache`, retried until idle), those the caller names (`push(flush=)`:
   not where the KV cache was released, since releasing it required an idle server and flushed it),
   then `/begin_weight_update` (distributed and tensor transports). The sync moves no server memory:
   colocated, the caller resumes the servers' weights before the push and their KV cache after
   (`placement.colocated_memory` decides which, per server: SGLang 0.5.23 ends a server asked to
   resume memory it holds, as a retried push or a restarted server would be). The outcome is broadcast to all ranks; a failure stops everyone here. A server
   whose `weight_version` is not the last pushed one restarted (or missed a push): the emitters
   then form new weight-update groups.
2. stream, every emitter in parallel (`groups.py`): each stage's, with DP > 1 (`SyncConfig.shares_dp`:
   the tensor and disk transports, and the distributed one with `weight_update_groups="per_emitter"`)
   every data-parallel replica's for its own share of the stage's dense buckets (else replica 0
   alone), and with EP > 1 each EP rank's for its own experts (gpt-oss: EP rank 0's for every EP
   rank's, which SGLang loads only fused: `resharder`): the TP (expert-TP) ranks gather
   their shards to their emitter (`Resharder`), which pushes each HF bucket through its
   transport. With more than one emitter they take turns at the servers (`SendLock`, lock.py: a
   server runs one update at a time, and emitters sending at once can deadlock): each send, and
   the forming of an emitter's weight-update group, holds the lock; gathering and converting do not. The
   coordinator keeps its last bucket back. A rank whose transport failed keeps iterating (its TP
   peers still gather) but sends nothing more. Tensor transport: the push runs in rounds, one per
   resharder step (`Resharder.buckets(every_step=True)`; their number is the most steps of any
   rank, agreed at the start); in each round every rank of the actor's world, taking part in the
   stream or not, runs one relay step per emitter in global-rank order (`ipc_copies.py`: each
   colocated rank serialises its own copy of that emitter's bucket of the round, the emitter
   posts), the coordinator's last bucket included (its entries wait for the commit). The
   resharder writes each bucket straight into memory a server may open (`hf_memory`: no copy),
   and a bucket's memory and its relayed copies are dropped once its request was answered: an
   emitter holds one bucket at a time besides its gather rows, a relaying rank one received copy
   plus the commit bucket's (kept until the commit was answered); those of failed requests are
   kept until the push's failure is known.
3. commit, coordinator: once every emitter reported success (gathered over the emitters' group), the
   held bucket goes out with `weight_version` (`/update_weights_from_disk` for the disk transport):
   that call alone bumps the version. Then `/end_weight_update`.
   With `check_weights`, before `/end_weight_update` every server's `/weights_checker` checksums
   are compared with those the emitters computed of the HF tensors they sent (`weight_check.py`);
   a difference fails the push naming the tensor and the server (the servers then report the new
   version with wrong weights: push again before generating).
4. The outcome and the metrics are broadcast to every rank: all return the same metrics, or all
   raise the same `WeightSyncError` naming the failed servers.

The chunks' parameters must be current when `push` starts (with megatron's distributed optimizer
and `overlap_param_gather` the engine finishes the parameters' all-gather after every update:
`engines.megatron.optim.gather_params_now`); offloaded parameters must be back on the device.

A failed push leaves the version where it was on every server that did not get the whole model and
ends the update session (a released KV cache stays released: the caller resumes it after a push that
succeeded); the next push rebuilds the weight-update groups and
sends everything again. Between a failed push and its retry, a server that kept its memory may
serve partly updated weights under its old version: retry (or stop) before generating again.
Call `close()` on every rank when done.
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Literal, Optional, Sequence

import torch
import torch.distributed as dist

from megarl.bridge import WeightMap
from megarl.bridge.fused_experts import PER_EXPERT, fuses_experts
from megarl.config.rules.qat import rollout_weights_format
from megarl.rollout import fp8
from megarl.rollout.control import ServerError, on_all
from megarl.sync.groups import WEIGHT_UPDATE_GROUPS, ParallelGroups
from megarl.sync import ipc_copies
from megarl.sync.ipc_copies import IpcRelay, copies_on_gpu
from megarl.sync.lock import SendLock
from megarl.sync.resharder import HFBucket, Resharder
from megarl.sync.servers import SyncServer
from megarl.sync.weight_check import bucket_checksums, mismatches, server_dtype
from megarl.sync.transports import DiskTransport, DistributedTransport, TensorTransport, Transport, route_address

log = logging.getLogger("megarl.sync")

TRANSPORTS = ("distributed", "tensor", "disk")
class WeightSyncError(RuntimeError):
    """A push that did not complete; the message names the servers and stages that failed."""


@dataclass(frozen=True)
class SyncConfig:
    transport: Literal["distributed", "tensor", "disk"] = "distributed"
    bucket_bytes: int = 512 * 2**20  # gathered megatron bytes per bucket
    dtype: Optional[torch.dtype] = None  # of the HF tensors sent (e.g. the servers' bf16); None: each parameter's
    backend: Optional[str] = None  # distributed, required: "nccl" or "gloo", as megarl.config.devices decides
    master_address: Optional[str] = None  # distributed: None = this node's address on the route to the first server
    disk_dir: Optional[str] = None  # disk: where pushes are written (visible to the servers)
    # disk: the HF directory whose config and tokenizer files are copied (FP8: the servers' FP8 checkpoint, whose
    # config.json carries the quantization_config)
    hf_assets_dir: Optional[str] = None
    timeout_s: float = 600.0  # seconds, each server call
    # seconds, every collective of the sync: the weight-update groups (forming them and each broadcast),
    # the colocated copies' relay group, the emitters' group (the trainer: actor_rollout_ref.nccl_timeout)
    group_timeout_s: float = 1800.0
    check_weights: bool = False  # after the commit, compare the servers' checksums with the tensors sent
    split_across_dp: bool = True  # DP > 1: every replica sends a disjoint share of the buckets (else replica 0 all),
    #                               where that costs no weight-update group (`shares_dp`)
    # distributed transport: "per_stage", one weight-update group per pipeline stage, from DP replica 0 (slime's
    # `slime-pp_{pp_rank}` from DP = TP = 0), plus one per EP rank's expert emitter at EP > 1; "per_emitter": every
    # DP replica's emitter also sends its share over a group of its own (PP x DP groups per server rank, each an NCCL
    # communicator with buffers outside SGLang's mem_fraction_static: docs/gpu.md). Counted by
    # groups.update_groups_per_server_rank.
    weight_update_groups: Literal["per_stage", "per_emitter"] = "per_stage"
    # tensor transport: colocated_peers[s][r] is the actor rank on server s's TP rank r's real GPU (the trainer
    # maps it from the GPUs Ray gave each bundle: placement.gpu_order); None: the planner's layout
    colocated_peers: Optional[list[list[int]]] = None
    # rollout.quantization=fp8: the HF weights pushed in block FP8, values and weight_scale_inv (the servers'
    # checkpoint's plan: megarl.sync.fp8_checkpoint); the other tensors go in `dtype`
    fp8_weights: frozenset[str] = frozenset()

    @property
    def shares_dp(self) -> bool:
        """Whether the DP replicas share each stage's dense buckets: with `split_across_dp`, unless
        each replica's emitter would form a weight-update group of its own (distributed, per_stage)."""
        return self.split_across_dp and not (self.transport == "distributed"
                                             and self.weight_update_groups == "per_stage")

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ValueError(f"weight sync: transport {self.transport!r} is not one of {list(TRANSPORTS)}")
        if self.bucket_bytes <= 0:
            raise ValueError(f"weight sync: bucket_bytes must be positive, got {self.bucket_bytes}")
        if self.transport == "disk" and not (self.disk_dir and self.hf_assets_dir):
            raise ValueError("weight sync: the disk transport needs disk_dir and hf_assets_dir")
        if self.transport == "distributed" and self.backend not in ("nccl", "gloo"):
            raise ValueError(f"weight sync: the distributed transport needs backend 'nccl' (SGLang on GPUs) or 'gloo' "
                             f"(CPU), got {self.backend!r}; megarl.config.devices.decide_devices decides it")
        if self.timeout_s <= 0:
            raise ValueError(f"weight sync: timeout_s must be positive, got {self.timeout_s}")
        if self.group_timeout_s <= 0:
            raise ValueError(f"weight sync: group_timeout_s must be positive, got {self.group_timeout_s}")
        if self.weight_update_groups not in WEIGHT_UPDATE_GROUPS:
            raise ValueError(f"weight sync: weight_update_groups {self.weight_update_groups!r} is not one of "
                             f"{list(WEIGHT_UPDATE_GROUPS)}")


@dataclass
class StageReport:
    """What one emitter did in a push (seconds are wall time on that emitter)."""

    stage: int
    replica: int = 0  # data-parallel replica of this emitter
    buckets: int = 0
    bytes: int = 0
    seconds: float = 0.0
    gather_s: float = 0.0  # waiting for the TP gathers
    convert_s: float = 0.0  # merging shards, HF conversion, packing
    send_s: float = 0.0  # in the transport
    peak_buffer_bytes: int = 0
    checksums: dict[str, str] = field(default_factory=dict)  # check_weights: {HF name: checksum} of what it sent
    check_s: float = 0.0  # hashing them
    error: Optional[str] = None
    result: Any = None  # the transport's finish_stream() result


def summarize(reports: Sequence[StageReport], seconds: float, prepare_s: float, commit_s: float) -> dict[str, float]:
    """The metrics of one push: totals over the stages and the slowest stage's breakdown."""
    slowest = max(reports, key=lambda r: r.seconds)
    total_bytes = sum(r.bytes for r in reports)
    return {
        "sync/seconds": seconds,
        "sync/bytes": float(total_bytes),
        "sync/gb_per_s": total_bytes / seconds / 1e9 if seconds > 0 else 0.0,
        "sync/buckets": float(sum(r.buckets for r in reports)),
        "sync/stages": float(len({r.stage for r in reports})),
        "sync/senders": float(len(reports)),  # emitters: stages x sending replicas, and EP ranks' expert emitters
        "sync/prepare_s": prepare_s,
        "sync/commit_s": commit_s,
        "sync/slowest_stage": float(slowest.stage),
        "sync/slowest_stage_s": slowest.seconds,
        "sync/slowest_stage_gather_s": slowest.gather_s,
        "sync/slowest_stage_convert_s": slowest.convert_s,
        "sync/slowest_stage_send_s": slowest.send_s,
        "sync/peak_buffer_bytes": float(max(r.peak_buffer_bytes for r in reports)),
    }


@dataclass
class _Outcome:
    """What the coordinator tells every rank, before the stream and after the commit."""

    errors: list[str] = field(default_factory=list)
    version: Optional[str] = None
    attempt: int = 0
    push_id: str = ""  # unique name of this attempt (the disk transport's directory)
    reconnect: bool = False  # a server does not hold the last pushed version (it restarted): form new groups
    check_dtype: Optional[str] = None  # check_weights: the servers' dtype, in which the emitters hash
    check_failed: bool = False  # the commit went through but a server's weights differ from those sent
    metrics: dict[str, float] = field(default_factory=dict)


Progress = Callable[[int, HFBucket], None]  # (pipeline stage, bucket just sent), on emitters


def servers_weight_map(weights: WeightMap, servers_draft: bool) -> WeightMap:
    """The map of what the servers load from the engine's `weights`: its multi-token-prediction layers
    only where the servers draft with them (verl's `model.mtp.enable_rollout`). SGLang 0.5.23's draft model
    loads `model.layers.<num_hidden_layers>.*` (models/deepseek_common/deepseek_weight_loader.py
    NextNEnabledConfig; weight updates reach it, scheduler_components/weight_updater.py `_select_runners`),
    and its target model drops those names (NextNDisabledConfig), so a server that does not draft gets none."""
    return replace(weights, mtp=weights.mtp and servers_draft)


def push_problem(weights: WeightMap, fp8_weights: frozenset[str] = frozenset()) -> Optional[str]:
    """Why the weights of this model cannot be pushed to SGLang under the names its model class
    loads, or None. gpt-oss's experts go as fused tensors of all experts (`resharder`); SGLang 0.5.23's
    GptOssForCausalLM loads those in block FP8 with no scales (models/gpt_oss.py `_load_normal_weights`:
    `FusedMoE.make_expert_params_mapping_fused` names no `weight_scale_inv`, which is skipped without a
    word), so they cannot be sent in block FP8."""
    fused_fp8 = sorted(n for n in fp8_weights if fuses_experts(weights.arch) and PER_EXPERT.match(n))
    if fused_fp8:
        return (f"gpt-oss experts cannot be pushed in block FP8 (SGLang's GptOssForCausalLM has no name for their "
                f"scales): {fused_fp8[:3]}")
    return None


class WeightSync:
    def __init__(
        self,
        model_chunks: Sequence[torch.nn.Module],
        weights: WeightMap,
        server_urls: Sequence[str],
        config: SyncConfig,
        *,
        groups: Optional[ParallelGroups] = None,
        api_key: Optional[str] = None,
        initial_version: int = 0,
    ):
        """`model_chunks`: this rank's megatron chunks (DDP/Float16Module wrappers allowed);
        `weights`: the bridge map of the model (its padded vocabulary is the chunks'); the servers'
        versions count up from `initial_version` (the first push sets initial_version + 1)."""
        if not server_urls:
            raise ValueError("weight sync: no rollout servers")
        problem = push_problem(weights, config.fp8_weights)
        if problem:
            raise ValueError(f"weight sync: {problem}")
        unknown = sorted(config.fp8_weights - set(weights.hf_names()))
        if unknown:
            raise ValueError(f"weight sync: fp8_weights names tensors the model does not have: {unknown[:5]}")
        self.config = config
        self.groups = groups or ParallelGroups.from_parallel_state(split_dp=config.shares_dp,
                                                                   timeout_s=config.group_timeout_s,
                                                                   fused_experts=fuses_experts(weights.arch))
        self.groups.check()
        self.weights = weights
        # the tensor transport's copies live on the actor's device (one decision for transport and relay)
        self.copies_on_gpu = copies_on_gpu(p.device.type for chunk in model_chunks for p in chunk.parameters())
        # tensor transport: each bucket is written straight into memory a server may open, and sent without a copy
        hf_memory = ((lambda nbytes: ipc_copies.shareable_empty(nbytes, self.copies_on_gpu))
                     if config.transport == "tensor" else None)
        # a QAT actor's weights go out as the NVFP4 values it computes with, dequantized (rollout_weights_format)
        self.resharder = Resharder(model_chunks, weights, self.groups, config.bucket_bytes, config.dtype, hf_memory,
                                   config.fp8_weights, fake_quant=rollout_weights_format() == "dequantized")
        self.servers = [SyncServer(url, api_key, timeout_s=config.timeout_s) for url in server_urls]
        self.version = initial_version  # the version of the last successful push
        self.attempts = 0
        self.transport: Optional[Transport] = self._make_transport() if self.groups.is_emitter else None
        # tensor transport: every rank serialises its own copy of each bucket (ipc_copies); collective
        self.relay = (IpcRelay(self.groups.is_emitter, self.copies_on_gpu, config.group_timeout_s,
                               self.groups.world_group) if config.transport == "tensor" else None)
        self.send_lock: Optional[SendLock] = self._make_send_lock()
        self._held: Optional[HFBucket] = None

    def _make_send_lock(self) -> Optional[SendLock]:
        """More than one emitter: the lock they hold while sending (lock.py), hosted by the
        coordinator; every rank takes part in sharing its address. None with one emitter."""
        g = self.groups
        if not g.several_emitters:
            return None
        lock, box = None, [None]
        # a waiter waits out the holder's step: a group collective and server calls, each within its bound
        wait_s = max(self.config.timeout_s, self.config.group_timeout_s)
        if g.is_coordinator:
            address = self.config.master_address or route_address(self.servers[0].url)
            lock, port = SendLock.host(address, "pipeline stage 0", wait_s)
            box = [(address, port)]
        dist.broadcast_object_list(box, src=g.coordinator_rank(), group=g.world_group)
        if g.is_emitter and not g.is_coordinator:
            lock = SendLock.join(*box[0], self._label(), wait_s)
        return lock

    def _at_servers(self, step: Callable[[], None]) -> None:
        """Run `step` (a call that reaches the servers) holding the send lock, if there is one."""
        if self.send_lock is None:
            step()
            return
        with self.send_lock:
            step()

    def _make_transport(self) -> Transport:
        c, stage = self.config, self.groups.pp_rank
        if c.transport == "distributed":
            return DistributedTransport(self.servers, stage, c.backend, c.master_address, c.group_timeout_s)
        if c.transport == "tensor":
            return TensorTransport(self.servers, dist.get_rank(), dist.get_world_size(), on_gpu=self.copies_on_gpu,
                                   peers=c.colocated_peers)
        names = self.weights.hf_names()
        return DiskTransport(self.servers, stage, c.disk_dir, c.hf_assets_dir,
                             names + [fp8.scale_name(n) for n in names if n in c.fp8_weights])

    # ------------------------------------------------------------------ the push
    def push(self, version: Optional[int] = None, progress: Optional[Progress] = None,
             flush: Optional[Sequence[bool]] = None) -> dict[str, float]:
        """Push the current weights; every actor rank calls this. `version` (the coordinator's
        counts): the servers' new `weight_version`, default the last successful one + 1.
        `progress(stage, bucket)` is called on each emitter after each bucket it sent. `flush`:
        per server, whether to drain its KV cache first (None: every server; colocated servers
        whose KV cache is released must not be: `placement.colocated_memory.flush_before_push`).
        Returns the metrics (same on every rank) or raises `WeightSyncError` (on every rank)."""
        g = self.groups
        started = time.perf_counter()
        decision = None
        if g.is_coordinator:
            attempt = self.attempts + 1
            decision = _Outcome(version=str(self.version + 1 if version is None else version), attempt=attempt,
                                push_id=f"{attempt:06d}-{uuid.uuid4().hex[:8]}")
            decision.errors, decision.reconnect, decision.check_dtype = self._prepare_servers(flush)
            decision.metrics["prepare_s"] = time.perf_counter() - started
        decision = self._from_coordinator(decision)
        self.attempts = decision.attempt
        if self.transport is not None and (decision.errors or decision.reconnect):
            self.transport.reset()
        if decision.errors:
            raise WeightSyncError(
                f"weight sync to version {decision.version} could not start: {'; '.join(decision.errors)}"
            )

        report = self._stream(decision, progress)
        reports = None
        if g.is_emitter and dist.get_world_size(g.emitter_group) == 1:
            reports = [report]  # the coordinator is the only emitter: nothing to gather
        elif g.is_emitter:
            reports = [None] * dist.get_world_size(g.emitter_group) if g.is_coordinator else None
            dist.gather_object(report, reports, dst=dist.get_global_rank(g.emitter_group, 0), group=g.emitter_group)
        outcome = None
        if g.is_coordinator:
            outcome = self._commit(reports, decision, started)
        outcome = self._from_coordinator(outcome)
        if self.relay is not None and not outcome.errors:
            self.relay.release()  # the commit was answered
        if outcome.errors:
            if self.relay is not None:
                self.relay.reset()  # the servers' sessions are over: copies of failed requests go too
            if self.transport is not None:
                self.transport.reset()
            if outcome.check_failed:
                raise WeightSyncError(
                    f"weight sync to version {outcome.version}: the servers' weights are not the actor's (they "
                    f"report version {outcome.version} nonetheless); push again before generating: "
                    f"{'; '.join(outcome.errors)}"
                )
            raise WeightSyncError(
                f"weight sync to version {outcome.version} failed; servers that did not get every tensor keep "
                f"their previous weight_version; push again to retry: {'; '.join(outcome.errors)}"
            )
        self.version = int(outcome.version)
        return outcome.metrics

    def close(self) -> None:
        """Drop the weight-update groups (emitters); every rank may call it."""
        if self.transport is not None:
            self.transport.reset()

    # ------------------------------------------------------------------ steps
    def _from_coordinator(self, outcome: Optional[_Outcome]) -> _Outcome:
        box = [outcome]
        dist.broadcast_object_list(box, src=self.groups.coordinator_rank(), group=self.groups.world_group)
        return box[0]

    def _prepare_servers(self, flush: Optional[Sequence[bool]]) -> tuple[list[str], bool, Optional[str]]:
        """(errors, whether a server lost the last pushed version, i.e. restarted, the servers'
        dtype if check_weights). `flush`: `push`'s."""
        session, check = self.transport.uses_session, self.config.check_weights
        if flush is not None and len(flush) != len(self.servers):
            raise ValueError(f"weight sync: flush names {len(flush)} servers, the sync has {len(self.servers)}")
        drained = {s.url for s, f in zip(self.servers, flush if flush is not None else [True] * len(self.servers)) if f}

        def prepare(server: SyncServer) -> tuple[str, Optional[str]]:
            # The version query is also the liveness probe (a dead server raises ServerError here), not
            # /health: on SGLang 0.5.23 /health runs a 1-token generate by default, one per push, and
            # a colocated server's KV cache may be released at this point.
            version = server.weight_version()
            dtype = server.server_info()["dtype"] if check else None
            if server.url in drained:
                server.flush_cache()
            if session:
                server.begin_weight_update()
            return version, dtype

        try:
            answers = on_all(self.servers, prepare)
        except ServerError as e:
            self._end_sessions()
            return [str(e)], True, None
        dtypes = sorted({dtype for _, dtype in answers if dtype is not None})
        if len(dtypes) > 1:
            self._end_sessions()
            return [f"check_weights: the servers hold different dtypes {dtypes}"], False, None
        return [], any(v != str(self.version) for v, _ in answers), dtypes[0] if dtypes else None

    def _end_sessions(self) -> list[str]:
        if not self.transport.uses_session:
            return []
        try:
            on_all(self.servers, lambda s: s.end_weight_update())
        except ServerError as e:
            return [str(e)]
        return []

    def _stream(self, decision: _Outcome, progress: Optional[Progress]) -> Optional[StageReport]:
        """Every rank: run this stage's resharder; on the emitter, push every bucket (the
        coordinator keeps its last one in `self._held`), hashing each first if check_weights.
        Tensor transport: one relay round per resharder step on every rank (`_relay_round`)."""
        g = self.groups
        report = StageReport(stage=g.pp_rank, replica=g.dp_rank)
        started = time.perf_counter()
        check_dtype = server_dtype(decision.check_dtype) if self.config.check_weights else None
        if g.is_emitter:
            report.error = self._guard(lambda: self._at_servers(lambda: self.transport.open_stream(decision.push_id)))
        relay = self.relay is not None
        rounds = self.relay.rounds(self.resharder.steps()) if relay else 0
        for bucket in self.resharder.buckets(every_step=relay):  # emitters only get buckets; every TP rank iterates
            sent = bucket is not None and self._emit(bucket, report, check_dtype)
            if relay:
                self._relay_round(report, commit=bucket is not None and self._held is bucket)
                rounds -= 1
            if sent and progress is not None and report.error is None:  # its request was answered
                progress(g.pp_rank, bucket)
            bucket = None  # dropped before the next one is made (tensor transport: one bucket's memory at a time)
        for _ in range(rounds):  # this rank's steps are done; the other ranks' rounds go on
            self._relay_round(report, commit=False)
        if g.is_emitter and report.error is None:
            sent = time.perf_counter()
            try:
                report.result = self.transport.finish_stream()
            except Exception as e:
                report.error = f"{type(e).__name__}: {e}"
            report.send_s += time.perf_counter() - sent
        report.seconds = time.perf_counter() - started
        t = self.resharder.timings
        report.gather_s, report.convert_s, report.peak_buffer_bytes = t.gather_s, t.convert_s, t.peak_buffer_bytes
        return report if g.is_emitter else None

    def _emit(self, bucket: HFBucket, report: StageReport, check_dtype) -> bool:
        """Emitter: hash `bucket` (check_weights), then hold it (the coordinator's last) or send it;
        after a failure only count it. Whether it was sent."""
        g = self.groups
        report.buckets += 1
        report.bytes += bucket.nbytes
        if report.error is not None:
            return False
        if self.config.check_weights:
            hashed = time.perf_counter()
            report.checksums.update(bucket_checksums(bucket, check_dtype))
            report.check_s += time.perf_counter() - hashed
        if g.is_coordinator and bucket.final:
            self._held = bucket
            return False
        sent = time.perf_counter()
        report.error = self._guard(lambda: self._at_servers(lambda: self.transport.send(bucket)))
        report.send_s += time.perf_counter() - sent
        return True

    def _relay_round(self, report: StageReport, commit: bool) -> None:
        """Every rank, tensor transport: one round of the relay (`ipc_copies`): this emitter's
        bucket of the round (the commit bucket if `commit`) reaches every colocated rank, each
        serialises its own copy, the emitter posts, the copies are dropped. A failed request or
        serialisation becomes the emitter's error; a collective's (timeout) raises."""
        g = self.groups
        box = []
        if g.is_emitter and report.error is None:
            report.error = self._guard(lambda: box.append(self.transport.outgoing(self._held if commit else None)))
        started = time.perf_counter()
        error = self.relay.round(box.pop() if box else None)  # no reference outlives the round
        if g.is_emitter:
            report.error = report.error or (error and f"{self._label()}: {error}")
            report.send_s += time.perf_counter() - started

    def _check_servers(self, reports: list[StageReport]) -> list[str]:
        """Coordinator, after the commit: every server's checksums against every stage's."""
        sent: dict[str, str] = {}
        for r in reports:
            sent.update(r.checksums)
        try:
            held = on_all(self.servers, lambda s: s.weights_checksums())
        except ServerError as e:
            return [f"check_weights: {e}"]
        return [problem for server, ranks in zip(self.servers, held) for problem in mismatches(server.url, sent, ranks)]

    def _label(self) -> str:
        g = self.groups
        parts = ([f"DP replica {g.dp_rank}"] if g.split_dp and g.emits_dense else []) + \
                ([("every EP rank's experts" if g.fused_experts else f"experts of EP rank {g.ep_rank}")]
                 if g.emits_experts else [])
        return f"pipeline stage {g.pp_rank}" + (f" ({', '.join(parts)})" if parts else "")

    def _guard(self, step: Callable[[], None], where: Optional[str] = None) -> Optional[str]:
        """None, or the error of `step()` as text: reported to the coordinator while this rank keeps
        its collectives going."""
        where = where or self._label()
        try:
            step()
        except Exception as e:
            return f"{where}: {e}" if isinstance(e, ServerError) else f"{where}: {type(e).__name__}: {e}"
        return None

    def _commit(self, reports: list[StageReport], decision: _Outcome, started: float) -> _Outcome:
        outcome = _Outcome(version=decision.version, attempt=decision.attempt)
        outcome.errors = [r.error for r in reports if r.error]
        held, self._held = self._held, None
        commit_started = time.perf_counter()
        if not outcome.errors:
            error = self._guard(lambda: self.transport.commit(held, [r.result for r in reports], decision.version),
                                "commit")
            outcome.errors = [error] if error else []
        if not outcome.errors and self.config.check_weights:
            checked = time.perf_counter()
            outcome.errors = self._check_servers(reports)
            outcome.check_failed = bool(outcome.errors)
            decision.metrics["check_s"] = time.perf_counter() - checked + max(r.check_s for r in reports)
            decision.metrics["checked_tensors"] = float(sum(len(r.checksums) for r in reports))
        outcome.errors += self._end_sessions()
        commit_s = time.perf_counter() - commit_started
        outcome.metrics = summarize(reports, time.perf_counter() - started, decision.metrics["prepare_s"], commit_s)
        if self.config.check_weights:  # slowest stage's hashing + asking the servers and comparing
            outcome.metrics["sync/check_s"] = decision.metrics.get("check_s", 0.0)
            outcome.metrics["sync/checked_tensors"] = decision.metrics.get("checked_tensors", 0.0)
        if outcome.errors:
            log.error("weight sync to version %s failed: %s", decision.version, "; ".join(outcome.errors))
        else:
            m = outcome.metrics
            log.info(
                "weight sync to version %s: %.3f GB in %.2f s (%.2f GB/s), %d buckets from %d stages; slowest "
                "stage %d: %.2f s (gather %.2f, convert %.2f, send %.2f)",
                decision.version, m["sync/bytes"] / 1e9, m["sync/seconds"], m["sync/gb_per_s"], m["sync/buckets"],
                m["sync/stages"], m["sync/slowest_stage"], m["sync/slowest_stage_s"],
                m["sync/slowest_stage_gather_s"], m["sync/slowest_stage_convert_s"], m["sync/slowest_stage_send_s"],
            )
        return outcome
