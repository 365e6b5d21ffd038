"""Training engines. Only megatron-core is supported."""
