"""Setup for every test: a relative PYTHONPATH (`PYTHONPATH=src pytest ...`, as in a git worktree)
is made absolute, so the subprocesses that tests start in their own directories (`cwd=tmp_path`)
import the same code as the tests do. An empty entry (the current directory) stays as it is.

No tqdm monitor thread: a progress bar (transformers' save_pretrained, the converter's) leaves one running,
and with a second Python thread alive `megarl.testing.run_gloo_workers` spawns its ranks, each importing
torch and megatron again (`gloo_start_method`), instead of forking them. Bars still show."""
import os

import tqdm

tqdm.tqdm.monitor_interval = 0

if os.environ.get("PYTHONPATH"):
    os.environ["PYTHONPATH"] = os.pathsep.join(os.path.abspath(entry) if entry else entry
                                               for entry in os.environ["PYTHONPATH"].split(os.pathsep))
