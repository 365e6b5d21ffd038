"""verl's `actor.checkpoint` keys (megarl.config.rules.checkpoint) against verl 0.9.1's own
CheckpointConfig (its wheel: the fields, their defaults and the parts its docstring names) and the
lists verl's Megatron scripts give (tests/config/verl/corpus.json)."""
import ast
import json
import logging
import os
import zipfile
from pathlib import Path

import pytest

from config_cases import fails, ok
from megarl.config.rules.checkpoint import CONTENTS, async_save_problem

REPO = Path(__file__).resolve().parents[2]
WHEEL = Path(os.environ.get("MEGARL_VERL_WHEEL") or REPO / ".verl-oracle" / "verl-0.9.1-py3-none-any.whl")
KEY = "actor_rollout_ref.actor.checkpoint"


def verl_checkpoint_config() -> tuple[dict, str]:
    """verl 0.9.1's CheckpointConfig: {field: default} and its docstring."""
    if not WHEEL.is_file():
        pytest.fail(f"verl 0.9.1's wheel is not at {WHEEL}: run `make install-verl-oracle` (or set MEGARL_VERL_WHEEL)")
    with zipfile.ZipFile(WHEEL) as wheel:
        tree = ast.parse(wheel.read("verl/trainer/config/config.py").decode())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CheckpointConfig"]
    fields = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign):
            value = node.value
            if isinstance(value, ast.Call):  # field(default_factory=lambda: [...])
                value = value.keywords[0].value.body
            fields[node.target.id] = ast.literal_eval(value)
    return fields, ast.get_docstring(cls)


def test_megarls_defaults_and_parts_are_verls():
    fields, doc = verl_checkpoint_config()
    config = ok()
    c = config.actor_rollout_ref.actor.checkpoint
    assert (c.save_contents, c.async_save) == (fields["save_contents"], fields["async_save"])
    assert "Options: " + ", ".join(f"'{name}'" for name in CONTENTS) + "." in " ".join(doc.split())


def test_the_corpus_lists_load(caplog):
    corpus = json.loads((REPO / "tests/config/verl/corpus.json").read_text())
    given = {a for s in corpus["scripts"] if s["module"] for a in s["args"] if a.startswith(f"{KEY}.save_contents=")}
    assert len(given) >= 3
    for text in sorted(given):
        with caplog.at_level(logging.WARNING, "megarl.config"):
            config = ok(text)
        assert set(config.actor_rollout_ref.actor.checkpoint.save_contents) <= set(CONTENTS)


def test_what_megarl_refuses_names_the_reason():
    assert "megarl's checkpoints always hold the model" in fails(f"{KEY}.save_contents=[optimizer,extra]")
    assert "['weights'] not among verl's parts" in fails(f"{KEY}.save_contents=[model,weights]")
    ok(f"{KEY}.async_save=false")
    assert ok(f"{KEY}.async_save=true").actor_rollout_ref.actor.checkpoint.async_save  # this Linux forks


@pytest.mark.parametrize("async_save, start_methods, refused", [
    (False, ["spawn"], False), (True, ["fork", "spawn", "forkserver"], False), (True, ["spawn"], True)])
def test_async_save_needs_megatrons_forked_writer(async_save, start_methods, refused):
    problem = async_save_problem(async_save, start_methods)
    assert (problem is not None) == refused
    if refused:
        assert "TemporalAsyncCaller" in problem and "cannot fork" in problem
