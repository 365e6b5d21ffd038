"""Rebuild tests/config/verl/corpus.json: the override lists of verl's Megatron launch scripts.

    python tools/verl_corpus.py [--verl GIT_DIR] [--recipe GIT_DIR] [--out FILE]

Each script (verl's examples/ and verl/experimental/*/shell/, verl-recipe; every *.sh whose path
names megatron) is run by bash with its defaults, as a user would run it, in an empty HOME with
`python`, `python3`, `uv`, `torchrun` and a few tools replaced by a recorder: the argument list of
its `python3 -m verl...` (or `-m recipe...`) line is kept, nothing else runs. The rollout is
switched to SGLang (INFER_BACKEND / ROLLOUT_NAME / rollout_name=sglang where the script reads one;
a literal vllm is mapped by megarl itself). GIT_DIRs are bare or work-tree-less git directories;
the scripts are read at HEAD.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

VERL = "/work/.mirror/verl-project+verl/repo"
RECIPE = "/work/.mirror/verl-project+verl-recipe/repo"
OUT = Path(__file__).resolve().parents[1] / "tests/config/verl/corpus.json"

# the recorder: `-m <module> args...` -> one JSON line. Other calls do nothing: `python3 -c 'import torch_npu'`
# (verl's device probe) fails, so a script picks its GPU branch; `git clone URL DIR` makes DIR for the script's `cd`
RECORDER = r'''#!PYTHON
import json, os, sys
args = sys.argv[1:]
if "-m" in args and args[args.index("-m") + 1].startswith(("verl", "recipe")):
    i = args.index("-m")
    line = {"module": args[i + 1], "args": args[i + 2:]}
    if os.path.basename(sys.argv[0]) == "torchrun":  # its own arguments: the layout verl's SFT trainer runs on
        line["launcher"] = ["torchrun", *args[:i]]
    with open(os.environ["CORPUS_RECORD"], "a") as f:
        f.write(json.dumps(line) + "\n")
elif args[:1] == ["clone"]:
    plain = [a for a in args[1:] if not a.startswith("-")]
    os.makedirs(plain[1] if len(plain) > 1 else plain[0].rstrip("/").rsplit("/", 1)[-1].removesuffix(".git"),
                exist_ok=True)
elif "-c" in args:
    sys.exit(1)
'''
SHIMS = ("python", "python3", "uv", "torchrun", "nvidia-smi", "pip", "pip3", "hf", "huggingface-cli", "wget",
         "ray", "git", "npu-smi", "sleep")
# the variables verl's scripts read for the rollout engine, set to SGLang (issue 52: "the rollout switched to SGLang")
SGLANG_ENV = {"INFER_BACKEND": "sglang", "ROLLOUT_NAME": "sglang", "rollout_name": "sglang", "ENGINE": "sglang",
              "rollout_engine": "sglang", "VERL_USE_UV": "1"}
# variables a script stops without (`${X:?...}` or `set -u`): the user must set them, so the corpus does too
REQUIRED_ENV = {
    "examples/grpo_trainer/run_deepseek_v4_flash_megatron.sh": {"HDFS_ROOT": "/hdfs"},
    "examples/grpo_trainer/run_nemotron_nano_v3_30b_a3b_megatron.sh": {"RAY_DATA_HOME": "/data/verl"},
    "examples/sft/gsm8k/run_nemotron_nano_v3_megatron.sh": {"ckpts_home": "/ckpts"},
    "examples/grpo_trainer/run_kimi_k2_6_glm5_1_megatron_lite.sh": {"MODEL_PATH": "moonshotai/Kimi-K2.6"},
    "examples/sft/gsm8k/run_deepseek_v4_megatron_lite.sh": {"MODEL_PATH": "deepseek-ai/DeepSeek-V4-Flash"},
}


def git(git_dir: str, *args: str) -> str:
    return subprocess.run(["git", "-C", git_dir, *args], check=True, capture_output=True, text=True).stdout


def megatron_scripts(git_dir: str, roots: tuple[str, ...]) -> list[str]:
    names = git(git_dir, "ls-tree", "-r", "--name-only", "HEAD").splitlines()
    return sorted(n for n in names if n.endswith(".sh") and "megatron" in n.lower()
                  and (not roots or n.startswith(roots)))


def run_script(text: str, work: Path, extra_env: dict) -> tuple[list[dict], str]:
    """Run one script's text under the recorder: its recorded `-m` lines, and the last line of its
    stderr (why it stopped, where it launched nothing)."""
    home, bin_dir = work / "home", work / "bin"
    home.mkdir(parents=True)
    bin_dir.mkdir()
    for name in SHIMS:
        (bin_dir / name).write_text(RECORDER.replace("PYTHON", sys.executable))
        (bin_dir / name).chmod(0o755)
    record = work / "record.jsonl"
    record.touch()
    (work / "script.sh").write_text(text)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(home), "CORPUS_RECORD": str(record), **SGLANG_ENV, **extra_env}
    stderr = b""
    try:  # a script that waits for a cluster would wait forever: what it launched so far counts
        stderr = subprocess.run(["bash", str(work / "script.sh")], cwd=home, env=env, capture_output=True,
                                timeout=30).stderr
    except subprocess.TimeoutExpired:
        pass
    last = (stderr.decode(errors="replace").strip().splitlines() or [""])[-1].replace(str(work), "")
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    for line in lines:  # the scratch HOME as a user's home, so that the corpus does not name a temporary path
        line["args"] = [a.replace(str(home), "/home/verl-user") for a in line["args"]]
    return lines, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--verl", default=VERL)
    parser.add_argument("--recipe", default=RECIPE)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    sources = [("verl-project/verl", args.verl, ("examples/", "verl/experimental/")),
               ("verl-project/verl-recipe", args.recipe, ())]
    corpus = {"about": __doc__.split("\n\n")[1].replace("\n", " "), "sources": [], "scripts": []}
    for repo, git_dir, roots in sources:
        commit, date = git(git_dir, "log", "-1", "--format=%H %cs", "HEAD").split()
        corpus["sources"].append({"repo": repo, "commit": commit, "date": date})
        for path in megatron_scripts(git_dir, roots):
            with tempfile.TemporaryDirectory() as tmp:
                env = REQUIRED_ENV.get(path, {})
                lines, last = run_script(git(git_dir, "show", f"HEAD:{path}"), Path(tmp), env)
            for k, line in enumerate(lines):
                corpus["scripts"].append({"repo": repo, "path": path, "commit": commit, "date": date,
                                          "launch": k, "env": env, "module": line["module"], "args": line["args"],
                                          **({"launcher": line["launcher"]} if "launcher" in line else {})})
            if not lines:
                corpus["scripts"].append({"repo": repo, "path": path, "commit": commit, "date": date,
                                          "launch": None, "env": env, "module": None, "args": [],
                                          "launches_nothing": last})
    Path(args.out).write_text(json.dumps(corpus, indent=1) + "\n")
    print(f"{len(corpus['scripts'])} launch lines -> {args.out}")


if __name__ == "__main__":
    main()
