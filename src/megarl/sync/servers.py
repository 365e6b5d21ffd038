"""The rollout servers as a sync sees them: `SyncServer`, `ServerControl` plus the calls only a sync
makes (tensor updates, the weights checker, LoRA adapters). Calls on every server at once go
through `megarl.rollout.control.on_all`."""
from __future__ import annotations

from typing import Optional

from megarl.rollout.control import ServerControl


class SyncServer(ServerControl):
    """`ServerControl` plus `/update_weights_from_tensor`, which only the colocated transport uses,
    `/weights_checker`, which only the equality check (`sync.weight_check`) uses, and the LoRA
    adapter calls of adapter-only sync (`sync.adapter_sync`)."""

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict:
        """SGLang 0.5.23's `LoadLoRAAdapterReqInput`: load the PEFT adapter in directory
        `lora_path` (visible to the server) as `lora_name`. Returns its `LoRAUpdateOutput`."""
        return self._call("POST", "/load_lora_adapter", {"lora_name": lora_name, "lora_path": lora_path})

    def load_lora_adapter_from_tensors(self, body: dict) -> dict:
        """SGLang 0.5.23's `LoadLoRAAdapterFromTensorsReqInput` (`body`: `sync.adapter_sync.from_tensors_request`):
        load the adapter whose tensors the request carries. Returns its `LoRAUpdateOutput`."""
        return self._call("POST", "/load_lora_adapter_from_tensors", body)

    def unload_lora_adapter(self, lora_name: str) -> dict:
        """SGLang 0.5.23's `UnloadLoRAAdapterReqInput` (waits for the requests using it)."""
        return self._call("POST", "/unload_lora_adapter", {"lora_name": lora_name})

    def update_weight_version(self, new_version: str) -> None:
        """SGLang 0.5.23's `UpdateWeightVersionReqInput`; the server must be idle (nothing aborted)."""
        self._call("POST", "/update_weight_version", {"new_version": new_version, "abort_all_requests": False})

    def weights_checksums(self) -> list[dict[str, str]]:
        """SGLang 0.5.23's `/weights_checker` with action "checksum" (`rollout.weights_checker`
        has the request and answer): per TP rank of the server, {tensor name: 16 hex digits}."""
        answer = self._call("POST", "/weights_checker", {"action": "checksum"})
        return [rank["checksums"] for rank in answer["ranks"]]

    def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: Optional[str] = None,
        weight_version: Optional[str] = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> None:
        """SGLang 0.5.23's request (`UpdateWeightsFromTensorReqInput`): one base64 payload per TP
        rank of the server (rank r reads entry r); `load_format` null (name, tensor) pairs or
        "flattened_bucket". Must run inside begin_weight_update() ... end_weight_update()."""
        self._call(
            "POST",
            "/update_weights_from_tensor",
            {
                "serialized_named_tensors": serialized_named_tensors,
                "load_format": load_format,
                "flush_cache": flush_cache,
                "abort_all_requests": abort_all_requests,
                "weight_version": weight_version,
            },
        )
