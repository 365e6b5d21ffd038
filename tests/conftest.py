"""Setup for every test: a relative PYTHONPATH (`PYTHONPATH=src pytest ...`, as in a git worktree)
is made absolute, so the subprocesses that tests start in their own directories (`cwd=tmp_path`)
import the same code as the tests do. An empty entry (the current directory) stays as it is."""
import os

if os.environ.get("PYTHONPATH"):
    os.environ["PYTHONPATH"] = os.pathsep.join(os.path.abspath(entry) if entry else entry
                                               for entry in os.environ["PYTHONPATH"].split(os.pathsep))
