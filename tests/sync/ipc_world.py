"""The body of the per-TP-rank copies check (test_ipc_copies.py): a 4-rank gloo world in which
ranks 0 and 2 are emitters (as stage 0 and stage 1 of TP 2 x PP 2) and two test-double servers
of TP sizes SERVER_TP record the requests they receive.

`RecordingServerDouble` stands in for a rollout server's `/server_info` and
`/update_weights_from_tensor` (the CPU engine serves TP 1 only, so a request with several entries
cannot reach a real one here). Like an SGLang TP worker, it opens each entry while the request is
in flight and records, per entry, the tensors it holds and the process that serialised it: torch
names a shared-memory file `/torch_<pid>_...` after the process that created it.
"""
from __future__ import annotations

import json
import os
import threading
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import torch.distributed as dist

from megarl.rollout import tensor_payload
from megarl.rollout.weight_group import bucket_layout, flatten_tensors
from megarl.sync.ipc_copies import IpcRelay
from megarl.sync.resharder import HFBucket
from megarl.sync.servers import SyncServer
from megarl.sync.transports import TensorTransport
from copy_tracker import CopyTracker

SERVER_TP = [1, 3]  # server 0 on GPU 0, server 1 on GPUs 1-3 (the planner's consecutive runs)
EMITTERS = {0: 2, 2: 3}  # emitter rank: buckets it emits (rank 0, the coordinator, keeps its last for the commit;
#                         stage 1 has more, so its last step runs while every rank holds the commit's copy)


def bucket_tensors(emitter: int, index: int) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of an emitter's bucket: seeded, so that the test rebuilds them independently."""
    gen = torch.Generator().manual_seed(100 * emitter + index)
    return [(f"model.layers.{emitter}.b{index}.weight", torch.randn(3, 5, generator=gen)),
            (f"model.layers.{emitter}.b{index}.bias", torch.randn(7, generator=gen).to(torch.bfloat16))]


def make_bucket(emitter: int, index: int) -> HFBucket:
    flat, fields = flatten_tensors(bucket_tensors(emitter, index))
    return HFBucket(index, EMITTERS[emitter], flat, tuple(bucket_layout(**fields)), final=index == EMITTERS[emitter] - 1)


class RecordingServerDouble:
    """A test double of a rollout server: records each `/update_weights_from_tensor` request;
    refuses the requests whose first tensor name is in `refuse` (HTTP 500)."""

    def __init__(self, tp_size: int):
        self.tp_size, self.records, self.refuse = tp_size, [], set()
        double = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _answer(self, status: int, body: dict):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer(200, {"tp_size": double.tp_size})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                entries = []
                for entry in body["serialized_named_tensors"]:
                    pairs = tensor_payload.named_tensors(tensor_payload.deserialize(entry), body["load_format"])
                    _, name, _ = pairs[0][1].untyped_storage()._share_filename_cpu_()
                    pid = int((name.decode() if isinstance(name, bytes) else name).split("_")[1])
                    entries.append({"pid": pid, "tensors": {n: t.clone() for n, t in pairs}})
                first = entries[0]["tensors"] and next(iter(entries[0]["tensors"]))
                double.records.append({"entries": entries, "weight_version": body["weight_version"],
                                       "flush_cache": body["flush_cache"], "refused": first in double.refuse})
                if first in double.refuse:
                    self._answer(500, {"success": False, "message": "refused by the test double"})
                else:
                    self._answer(200, {"success": True})

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()


def push(rank: int, relay: IpcRelay, transport, version: str, tracker: CopyTracker) -> dict:
    """What WeightSync does for the tensor transport: one relay round per step (an emitter's step:
    one bucket sent, or the coordinator's last held for the commit), the coordinator commits,
    every rank releases the commit's copies (or, after a failure, resets)."""
    out = {"error": None, "pending": []}
    tracker.reset()
    steps = EMITTERS.get(rank, 0)
    commit_bucket = None
    if transport is not None:
        transport.open_stream("push")
    for index in range(relay.rounds(steps)):
        item = None
        if index < steps and out["error"] is None:
            bucket = make_bucket(rank, index)
            if rank == 0 and bucket.final:
                commit_bucket = bucket
                item = transport.outgoing(commit_bucket)
            else:
                transport.send(bucket)
                out["pending"].append(len(transport.in_flight))
                item = transport.outgoing()
        error = relay.round(item)
        del item  # no copy outlives its round here (WeightSync's box)
        out["error"] = out["error"] or error
    out["held_after_rounds"] = len(relay.in_flight)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, out["error"])  # WeightSync gathers the emitters' reports
    if rank == 0 and not any(errors):
        transport.commit(commit_bucket, [], version)
    dist.barrier()
    if any(errors):
        relay.reset()
        if transport is not None:
            transport.reset()
    else:
        relay.release()
    out["held_after_release"] = len(relay.in_flight)
    out["peak_copy_bytes"], out["copies"] = tracker.peak_bytes, tracker.copies
    out["bucket_bytes"] = make_bucket(0, 0).flat.numel()
    return out


def relay_world(rank: int, world_size: int, port: int) -> dict:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=60))
    doubles = [RecordingServerDouble(tp) for tp in SERVER_TP] if rank == 0 else None
    urls = [[d.url for d in doubles] if rank == 0 else None]
    dist.broadcast_object_list(urls, src=0)
    relay = IpcRelay(rank in EMITTERS, on_gpu=False, timeout_s=30)
    transport = TensorTransport([SyncServer(u, timeout_s=30) for u in urls[0]], rank, world_size) \
        if rank in EMITTERS else None
    out = {"pid": os.getpid(), "emitters": relay.emitters}
    tracker = CopyTracker().install()
    out["first"] = push(rank, relay, transport, "7", tracker)
    if rank == 0:
        out["first_records"] = [d.records for d in doubles]
        for d in doubles:
            d.records = []
        doubles[1].refuse = {bucket_tensors(2, 0)[0][0]}  # server 1 refuses stage 1's first bucket
    dist.barrier()
    out["refused"] = push(rank, relay, transport, "8", tracker)
    if rank == 0:
        out["refused_records"] = [d.records for d in doubles]
        for d in doubles:
            d.http.shutdown()
    dist.destroy_process_group()
    return out
