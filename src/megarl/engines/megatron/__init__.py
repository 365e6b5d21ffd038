"""The megatron-core engine and its CPU compatibility shims (`cpu`)."""
