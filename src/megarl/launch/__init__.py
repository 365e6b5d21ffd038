"""Launching an experiment on a Ray cluster that megarl starts itself: on one machine
(`launch/local.sh` -> `local`) or across a Slurm allocation (`slurm/megarl.sbatch` -> `slurm`).

Both do the same four things, in `session`: start one Ray node after another and wait for each to
join (`ray_nodes`), prove the cluster can host the placement plan (`check`), run the experiment
with signal forwarding, and stop exactly the Ray processes they started. `sbatch` renders the
sbatch script for `megarl submit` so that the allocation matches the config.
"""
