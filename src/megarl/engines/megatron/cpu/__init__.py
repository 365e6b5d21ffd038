"""The stand-in for CUDA and NCCL under megatron-core: shims that let the real megatron-core run on
a CPU-only torch build over gloo (the tests, `make demo`, CPU experiments). Applied only when CUDA
is absent (`engines.megatron.parallel.init_role_parallel_state`); on GPUs nothing here runs, but for
one MoE shim that fixes a megatron-core bug wherever transformer-engine is absent
(`moe_shims`, `te_general_gemm`).

- `shims`: the dense shims, pinned to the megatron-core versions they were verified on.
- `moe_shims`: the MoE layers' shims (expert parallelism over gloo), applied after the dense ones.

The harness that starts gloo worlds of such ranks for tests and benchmarks is `megarl.testing`.
"""
