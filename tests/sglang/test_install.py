"""The SGLang venv `make install-sglang` builds, and the check a run makes before it starts servers from it."""
import os
import subprocess
import sys

from megarl.rollout.launch import sglang_server_env
from megarl.trainer.preflight import sglang_install_problem
from real_sglang import REPO, sglang_python


def test_the_sglang_venv_has_sglang_0_5_23_on_the_cpu_build_of_torch():
    env = sglang_server_env(os.environ, device="cpu", enable_memory_saver=False, colocated=False)
    out = subprocess.run([sglang_python(), "-c", "import sglang, torch; print(sglang.__version__, torch.version.cuda)"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["0.5.23", "None"]  # a CUDA torch would kill the scheduler at its first release


def test_a_run_checks_that_its_server_python_has_sglang():
    assert sglang_install_problem(sglang_python(), on_cuda=False) is None
    megarls_own = sglang_install_problem(sys.executable, on_cuda=False)  # megarl's venv has no sglang
    assert f"server_python={sys.executable} has no sglang (make install-sglang" in megarls_own
    missing = sglang_install_problem(str(REPO / "no-such-python"), on_cuda=False)
    assert "cannot run it" in missing
    assert "pip install -e .[gpu]" in sglang_install_problem(None, on_cuda=True)  # this interpreter has none
