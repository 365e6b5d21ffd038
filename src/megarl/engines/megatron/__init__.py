"""The megatron-core engine: actor, reference and critic models with TP/PP(/VPP), on GPUs (NCCL,
transformer-engine when installed) and on CPUs (gloo, with the shims of `cpu`).

    from megarl.engines.megatron import ActorEngine, RefEngine, CriticEngine   # (from .roles)

    roles      ActorEngine, RefEngine, CriticEngine, TeacherEngine: the API the controller's workers call
    reward_model  RewardModelEngine: a sequence-classification reward model, forward only
    engine     MegatronEngine: model chunks and the parts below composed into one role's engine
    model      building GPTModel chunks and loading HF weights into them (via the bridge)
    heads      vocabulary-parallel log-probs and entropy (chunked), the critic's value head
    sequences  Batch -> micro-batches (padded or packed layout)
    schedule   micro-batches through megatron's pipeline schedules, a head on the last stage
    training   an update's parts: mini-batch order, loss scaling, the non-finite-gradient check
    metrics    the loss heads' metrics reduced over micro-batches and DP ranks, as each declares
    optim      megatron DDP, optimizer and LR schedule from the config
    offload    moving an engine's storages to host memory and back
    checkpoint_io  torch_dist checkpoints (model, optimizer, LR schedule)
    parallel   megatron's parallel state for a role inside a started torch.distributed world
    cpu        the stand-in for CUDA on CPUs: megatron-core's shims (dense and MoE), applied only
               without CUDA

The role classes are imported on first use, so `import megarl.engines.megatron.cpu.shims` stays cheap.
"""
ROLES = ("ActorEngine", "RefEngine", "CriticEngine", "TeacherEngine")


def __getattr__(name: str):
    if name in ROLES:
        from megarl.engines.megatron import roles

        return getattr(roles, name)
    if name == "RewardModelEngine":
        from megarl.engines.megatron.reward_model import RewardModelEngine

        return RewardModelEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
