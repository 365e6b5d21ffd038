"""What the loops drive, apart from the loops: the Ray-placed training roles and rollout servers of
one run, and the phases of a step over them.

    cluster        `Cluster`: every role and the rollout fleet brought up from the plan; the phases
                   of a step (training, push, rollout) with their colocated memory moves, restarts
                   and retries; checkpoints across roles
    rollout_fleet  `RolloutFleet`: the rollout servers behind sglang-router and the client
    roles          the typed handles the loops call (`actor.update_policy(batch)`)
    engine_group   a training role's workers, the batch cut by DP rank and the outputs joined
    devices        the run's device, backends and transport, decided before any worker starts
    routing        routing replay: what the rollout client asks the servers for
"""
