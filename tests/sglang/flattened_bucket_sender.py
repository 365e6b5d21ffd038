"""Push an HF checkpoint into a real SGLang server as one `flattened_bucket` over
`/update_weights_from_tensor`, inside `/begin_weight_update` ... `/end_weight_update`.

Runs under SGLang's interpreter (the bucket's metadata must be SGLang's own `FlattenedTensorMetadata`,
which only a process with SGLang installed can make) with megarl's `src` on PYTHONPATH, and builds the
bucket with megarl's own code: `weight_group.flatten_tensors` / `bucket_layout` (the byte layout),
`tensor_payload.shared_cpu_copy` (shared memory) and `ipc_copies.flattened_bucket_entry` (the entry
the GPU path sends), serialised with CPU storage shared by file name.

    python flattened_bucket_sender.py URL HF_DIR WEIGHT_VERSION [API_KEY]

Prints one JSON line: {"tensors": n, "bytes": b}. Run it with stdout and stderr in files, not pipes:
torch's shared-memory manager, started by the first share, inherits them and lives as long as the server.
"""
import json
import sys
from pathlib import Path

from safetensors.torch import load_file

from megarl.rollout import tensor_payload
from megarl.rollout.weight_group import bucket_layout, flatten_tensors
from megarl.sync.ipc_copies import flattened_bucket_entry
from megarl.sync.servers import SyncServer


def main(url: str, hf_dir: str, version: str, api_key=None) -> None:
    named = [(name, tensor) for file in sorted(Path(hf_dir).glob("*.safetensors"))
             for name, tensor in load_file(file).items()]
    flat, fields = flatten_tensors(named)
    copy = tensor_payload.shared_cpu_copy(flat)  # alive until the server answered
    with tensor_payload.file_system_sharing():
        entry = flattened_bucket_entry(copy, bucket_layout(**fields))
    server = SyncServer(url, api_key, timeout_s=120)
    server.begin_weight_update()
    try:
        server.update_weights_from_tensor([entry], "flattened_bucket", weight_version=version, flush_cache=True)
    finally:
        server.end_weight_update()
    print(json.dumps({"tensors": len(named), "bytes": copy.numel()}), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
