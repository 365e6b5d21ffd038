# Set-up and entry points. `make test` and `make demo` are all a fresh machine needs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.megarl-installed
LOCK   := requirements/cpu-py$(shell $(PYTHON) -c 'import sys; print("%d%d" % sys.version_info[:2])').lock
PYTEST_ARGS ?=

# The second tested line: Python 3.12 with the newest megatron-core it resolves (0.19.x). The
# interpreter comes from pyenv when it has a 3.12, else `python3.12` on PATH. PyPI has no CPU
# build of torch for 3.12, so this venv gets the CUDA build of torch 2.13.0 (it runs on the CPU;
# requirements/cpu-py312.lock pins it with its nvidia-* wheels).
PYTHON312 ?= $(shell p=$$(pyenv prefix 3.12 2>/dev/null) && test -x "$$p/bin/python3.12" && echo "$$p/bin/python3.12" || echo python3.12)
VENV312   := .venv312
PY312     := $(VENV312)/bin/python
STAMP312  := $(VENV312)/.megarl-installed
LOCK312   := requirements/cpu-py312.lock
# The tests that touch megatron-core, run again on the second line (README "Tested versions"):
# bridge (HF <-> megatron-core mapping, torch_dist I/O), engines (GPTModel, schedules, optimizer,
# offload, engine checkpoints, LoRA, MoE, the CPU shims), sync (the resharder over megatron's
# groups), the conversion tools, and the whole RL loop end to end (GRPO colocated). `.ci/run`
# runs it beside line 1.
# Left out: the files of these folders that never import megatron-core (the send lock; the tools'
# model, data and jsonl helpers), which line 1 runs.
PY312_TESTS ?= tests/bridge tests/engines tests/sync --ignore=tests/sync/test_send_lock.py \
	tests/tools/test_tools.py::test_the_gpu_check_script_runs_its_bf16_path_on_cpu \
	tests/trainer/test_rl_e2e.py::test_grpo_colocated

# Real SGLang 0.5.23 serving on the CPU, for the tests that run it (tests/sglang/) and for
# `actor_rollout_ref.rollout.name=sglang` without a GPU (docs/sglang-on-cpu.md): its own venv, since SGLang
# pins other versions than megarl's (transformers, tokenizers). The lock (`make lock`) holds SGLang without
# its CUDA requirements and the CPU build of torch; the check after it refuses a CUDA build, under which
# SGLang's scheduler dies at its first memory release.
VENV_SGLANG  := .venv-sglang
PY_SGLANG    := $(VENV_SGLANG)/bin/python
STAMP_SGLANG := $(VENV_SGLANG)/.megarl-installed
LOCK_SGLANG  := requirements/sglang-cpu-py311.lock
PYTHON311    ?= $(shell $(PYTHON) -c 'import sys; print(sys.version_info[:2] == (3, 11))' | grep -q True && echo $(PYTHON) || echo python3.11)

# verl 0.9.1's wheel, for the test that runs verl's own rollout corrections against megarl's
# (tests/algos/test_rollout_correction_verl.py): downloaded once, hash-checked, never installed (the
# test reads verl's files out of it and needs none of verl's dependencies); MEGARL_VERL_WHEEL names it.
VERL_ORACLE       := .verl-oracle
VERL_ORACLE_LOCK  := requirements/verl-oracle.lock
STAMP_VERL_ORACLE := $(VERL_ORACLE)/.megarl-downloaded
# NVIDIA ModelOpt 0.47.0's wheel, the same way, for tests/algos/test_nvfp4_modelopt.py (ModelOpt's own
# NVFP4 quantize/dequantize against megarl's); MEGARL_MODELOPT_WHEEL names it.
MODELOPT_ORACLE       := .modelopt-oracle
MODELOPT_ORACLE_LOCK  := requirements/modelopt-oracle.lock
STAMP_MODELOPT_ORACLE := $(MODELOPT_ORACLE)/.megarl-downloaded

.PHONY: install test demo clean install-py312 test-py312 install-sglang test-sglang install-verl-oracle install-modelopt-oracle lock

# Installs once; again when setup.py or the lock changes. The lock (requirements/cpu-py3X.lock of
# $(PYTHON)'s version, written by `make lock`) pins every package, so tests and benchmarks see the
# same versions on every machine; megarl itself installs editable on top, without dependencies.
# Its torch==2.13.0 is the CPU build where pip's configured indexes offer one (these machines).
$(STAMP): setup.py $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r $(LOCK)
	$(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

test: install install-sglang install-verl-oracle install-modelopt-oracle
	MEGARL_SGLANG_PYTHON=$(abspath $(PY_SGLANG)) MEGARL_VERL_WHEEL=$(abspath $(VERL_ORACLE))/verl-0.9.1-py3-none-any.whl \
		MEGARL_MODELOPT_WHEEL=$(abspath $(MODELOPT_ORACLE))/nvidia_modelopt-0.47.0-py3-none-any.whl \
		$(PY) -m pytest $(PYTEST_ARGS)

# Resolves every lock again with each line's pip (installs nothing; `make install` then installs
# what changed): the CPU test sets (requirements/cpu-py3*.lock), the benchmark environment's
# additions (requirements/bench-py311.lock, resolved on top of the new cpu-py311.lock) and the GPU
# sets (requirements/gpu-py3*.lock).
lock: install install-py312
	$(PY) tools/lock_cpu.py --python $(PY)
	$(PY) tools/lock_cpu.py --python $(PY312)
	$(PY) tools/lock_cpu.py --python $(PY) --bench
	$(PY) tools/lock_cpu.py --python $(PY) --sglang
	$(PY) tools/lock_gpu.py --python $(PY)
	$(PY312) tools/lock_gpu.py --python $(PY312)

# Installs the second line once (again when setup.py or its lock changes) and runs its test set.
$(STAMP312): setup.py $(LOCK312)
	test -x $(PY312) || $(PYTHON312) -m venv $(VENV312)
	$(PY312) -m pip install -q --upgrade pip
	$(PY312) -m pip install -q -r $(LOCK312)
	$(PY312) -m pip install -q --no-deps -e .
	touch $(STAMP312)

install-py312: $(STAMP312)

test-py312: install-py312
	$(PY312) -m pytest $(PY312_TESTS) $(PYTEST_ARGS)

$(STAMP_SGLANG): $(LOCK_SGLANG)
	test -x $(PY_SGLANG) || $(PYTHON311) -m venv $(VENV_SGLANG)
	$(PY_SGLANG) -m pip install -q --upgrade pip
	$(PY_SGLANG) -m pip install -q --no-deps -r $(LOCK_SGLANG)
	$(PY_SGLANG) -c 'import torch, sys; sys.exit(torch.version.cuda and "$(VENV_SGLANG): torch " + torch.__version__ + " is a CUDA build; SGLang on the CPU needs the CPU build")'
	touch $(STAMP_SGLANG)

install-sglang: $(STAMP_SGLANG)

$(STAMP_VERL_ORACLE): $(VERL_ORACLE_LOCK) | $(STAMP)
	$(PY) -m pip download -q --no-deps --require-hashes -r $(VERL_ORACLE_LOCK) -d $(VERL_ORACLE)
	touch $(STAMP_VERL_ORACLE)

install-verl-oracle: $(STAMP_VERL_ORACLE)

$(STAMP_MODELOPT_ORACLE): $(MODELOPT_ORACLE_LOCK) | $(STAMP)
	$(PY) -m pip download -q --no-deps --require-hashes -r $(MODELOPT_ORACLE_LOCK) -d $(MODELOPT_ORACLE)
	touch $(STAMP_MODELOPT_ORACLE)

install-modelopt-oracle: $(STAMP_MODELOPT_ORACLE)

# The real-SGLang tier alone (`make test` runs it too); `.ci/run` runs it beside line 1.
test-sglang: install install-sglang
	MEGARL_SGLANG_PYTHON=$(abspath $(PY_SGLANG)) $(PY) -m pytest tests/sglang $(PYTEST_ARGS)

demo: install
	$(PY) -m megarl.demo

clean:
	rm -rf $(VENV) $(VENV312) $(VENV_SGLANG) $(VERL_ORACLE) $(MODELOPT_ORACLE) build src/*.egg-info outputs
