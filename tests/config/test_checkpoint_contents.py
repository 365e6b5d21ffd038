"""verl's `actor.checkpoint` and `critic.checkpoint` keys (megarl.config.rules.checkpoint,
megarl.checkpoint.loads_optimizer) against verl 0.9.1's own CheckpointConfig (its wheel: the fields,
their defaults, the parts its docstring names, load_contents' default in its YAML) and the lists
verl's Megatron scripts give (tests/config/verl/corpus.json)."""
import ast
import json
import logging
import os
import zipfile
from dataclasses import fields as dataclass_fields
from pathlib import Path

import pytest
import yaml

from config_cases import fails, ok
from megarl.checkpoint import loads_optimizer
from megarl.config import ConfigError, to_yaml
from megarl.config.schema import CheckpointConfig
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


def verl_yaml(path: str) -> dict:
    with zipfile.ZipFile(WHEEL) as wheel:
        return yaml.safe_load(wheel.read(path))


def test_megarls_fields_defaults_and_parts_are_verls():
    fields, doc = verl_checkpoint_config()
    assert [f.name for f in dataclass_fields(CheckpointConfig)] == list(fields)
    config = ok()
    for c in (config.actor_rollout_ref.actor.checkpoint, config.critic.checkpoint):
        assert (c.save_contents, c.async_save, c.strict, c.save_lora_only) == (
            fields["save_contents"], fields["async_save"], fields["strict"], fields["save_lora_only"])
        assert c.load_contents is None  # verl's YAML: ${.save_contents}
    assert fields["load_contents"] == fields["save_contents"]
    assert verl_yaml("verl/trainer/config/actor/actor.yaml")["checkpoint"]["load_contents"] == "${.save_contents}"
    # the critic's checkpoint section is the same class in verl (its Megatron subclass)
    critic = verl_yaml("verl/trainer/config/critic/megatron_critic.yaml")["checkpoint"]
    assert critic["_target_"] == "verl.workers.config.McoreCheckpointConfig"
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
    assert "always load the model" in fails(f"{KEY}.load_contents=[optimizer,extra]")
    assert "['rng'] not among verl's parts" in fails("critic.checkpoint.load_contents=[model,rng]")
    assert "hf_model is not built for a critic" in fails("critic.checkpoint.save_contents=[model,hf_model]")
    assert ok("critic.checkpoint.async_save=true").critic.checkpoint.async_save  # this Linux forks
    c = ok("critic.checkpoint.save_contents=[model,extra]", f"{KEY}.load_contents=[model,hf_model]")
    assert c.critic.checkpoint.save_contents == ["model", "extra"]
    # a critic that does not run saves nothing: its keys are not checked (verl reads them only to build one)
    ok("algorithm.adv_estimator=grpo", "critic.checkpoint.save_contents=[model,hf_model]",
       "critic.checkpoint.async_save=true")
    assert ok(f"{KEY}.async_save=true").actor_rollout_ref.actor.checkpoint.async_save  # this Linux forks



@pytest.mark.parametrize("override, warned", [
    (f"{KEY}.strict=false", f"{KEY}.strict=false has no effect"),
    ("critic.checkpoint.strict=false", "critic.checkpoint.strict=false has no effect"),
    (f"{KEY}.save_lora_only=true", f"{KEY}.save_lora_only=true has no effect"),
    (f"{KEY}.strict=true", None),
    (f"{KEY}.save_lora_only=false", None),
])
def test_export_options_without_meaning_here_warn_once(caplog, override, warned):
    with caplog.at_level(logging.WARNING, "megarl.config"):
        ok(override)
    found = [r.getMessage() for r in caplog.records if "has no effect" in r.getMessage()]
    assert len(found) == (0 if warned is None else 1)
    assert warned is None or found[0].startswith(warned)


def checkpoint_of(tmp_path: Path, *overrides: str) -> Path:
    """A checkpoint directory holding only the config.yaml of a run with `overrides` (what
    loads_optimizer reads of it)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.yaml").write_text(to_yaml(ok(*overrides)))
    return tmp_path


# verl: CheckpointManager.should_load_optimizer is "optimizer" in load_contents, and its load fails
# on a checkpoint without optimizer state; load_contents defaults to save_contents
@pytest.mark.parametrize("role, saved, load, loads", [
    ("actor", "[model,optimizer,extra]", None, True),
    ("actor", "[model,extra]", None, False),
    ("actor", "[model,optimizer,extra]", "[model,extra]", False),
    ("actor", "[model,optimizer]", "[model,optimizer]", True),
    ("actor", "[model,extra]", "[model,optimizer]", ConfigError),
    ("critic", "[model,extra]", None, False),
    ("critic", "[model,optimizer]", "[model]", False),
    ("critic", "[model]", "[model,optimizer]", ConfigError),
])
def test_load_contents_decides_whether_a_resume_loads_the_optimizer(tmp_path, role, saved, load, loads):
    key = KEY if role == "actor" else "critic.checkpoint"
    directory = checkpoint_of(tmp_path / "ckpt", f"{key}.save_contents={saved}")
    config = ok(*([f"{key}.load_contents={load}"] if load else []))
    if loads is ConfigError:
        with pytest.raises(ConfigError, match="holds no .* optimizer"):
            loads_optimizer(config, directory, role)
    else:
        assert loads_optimizer(config, directory, role) is loads
        # the other role's contents decide nothing here
        other = "critic" if role == "actor" else "actor"
        assert loads_optimizer(config, directory, other) is True


@pytest.mark.parametrize("async_save, start_methods, refused", [
    (False, ["spawn"], False), (True, ["fork", "spawn", "forkserver"], False), (True, ["spawn"], True)])
def test_async_save_needs_megatrons_forked_writer(async_save, start_methods, refused):
    problem = async_save_problem(async_save, start_methods)
    assert (problem is not None) == refused
    if refused:
        assert "TemporalAsyncCaller" in problem and "cannot fork" in problem
