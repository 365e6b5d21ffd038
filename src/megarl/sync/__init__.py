"""Weight sync: the actor's TP/PP-sharded megatron weights -> full HF tensors in buckets
(`Resharder`) -> the rollout servers (`transports`), driven by `WeightSync.push` on every actor rank."""
from megarl.sync.groups import ParallelGroups
from megarl.sync.resharder import HFBucket, Resharder, local_params, plan_buckets
from megarl.sync.weight_sync import SyncConfig, WeightSync, WeightSyncError

__all__ = [
    "HFBucket",
    "ParallelGroups",
    "Resharder",
    "SyncConfig",
    "WeightSync",
    "WeightSyncError",
    "local_params",
    "plan_buckets",
]
