"""Rules on verl's profiler keys (megarl.config.profiler); the device's part is
`devices_from_config`'s (megarl.config.rules.devices.weight_sync_transport_fits_devices)."""
from __future__ import annotations

from collections.abc import Iterator

from megarl.config.profiler import profiler_settings_problems
from megarl.config.rules.common import DerivedSizes
from megarl.config.schema import ExperimentConfig


def profiler_settings(config: ExperimentConfig, sizes: DerivedSizes) -> Iterator[str]:
    """The profiler's tool, steps, ranks and torch contents, and what megarl does not profile
    (`profiler_settings_problems`).

    Reads: global_profiler, actor_rollout_ref.actor.profiler, actor_rollout_ref.ref.profiler,
    actor_rollout_ref.rollout.profiler, critic.profiler
    """
    yield from profiler_settings_problems(config)
