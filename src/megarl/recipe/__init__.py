"""verl-recipe's entry points under megarl's name: rename the package in a verl-recipe script
(`python3 -m recipe.X` -> `python3 -m megarl.recipe.X`) and the same keys run the same trainer
(docs/verl-compat.md lists them)."""
