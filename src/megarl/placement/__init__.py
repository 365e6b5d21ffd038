"""Placement: the pure planner (cluster + role sizes -> GPU map), its memory estimate, and its
realisation as Ray placement groups and worker groups (imported from their modules, since they
need Ray)."""
from megarl.placement.from_config import plan_from_config, roles_from_config
from megarl.placement.planner import ClusterSpec, Device, Plan, PlanError, RoleSpec, format_gpu_map, plan_placement

__all__ = [
    "ClusterSpec",
    "Device",
    "Plan",
    "PlanError",
    "RoleSpec",
    "format_gpu_map",
    "plan_from_config",
    "plan_placement",
    "roles_from_config",
]
