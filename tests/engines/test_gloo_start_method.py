"""How the CPU gloo worlds start their ranks: fork (no re-import of torch and megatron) only where
forking is safe, each case against the rule it follows."""
from megarl.engines.megatron.cpu import gloo_start_method


def test_fork_only_without_cuda_a_process_group_or_other_threads():
    assert gloo_start_method(cuda_initialized=False, dist_initialized=False, python_threads=1) == "fork"
    # "The CUDA runtime does not support the fork start method" (PyTorch's multiprocessing notes)
    assert gloo_start_method(cuda_initialized=True, dist_initialized=False, python_threads=1) == "spawn"
    # the children would share this process's process-group sockets
    assert gloo_start_method(cuda_initialized=False, dist_initialized=True, python_threads=1) == "spawn"
    # another thread's locks stay locked forever in the child (Python's os.fork documentation)
    assert gloo_start_method(cuda_initialized=False, dist_initialized=False, python_threads=2) == "spawn"
