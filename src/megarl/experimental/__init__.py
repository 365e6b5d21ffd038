"""verl's `verl.experimental` entry points under megarl's name: rename the package in a verl script
(`python3 -m verl.experimental.X` -> `python3 -m megarl.experimental.X`) and the same keys run the
same mode (docs/verl-compat.md lists them)."""
