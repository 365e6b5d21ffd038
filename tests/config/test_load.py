"""Loading: defaults, YAML experiment files with includes, dotted overrides of every type."""
import textwrap

import pytest
import yaml

from megarl.config import ConfigError, ExperimentConfig, load_and_validate, load_config, to_yaml


def write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


def test_defaults_match_schema():
    assert load_config() == ExperimentConfig()


@pytest.mark.parametrize(
    "override, getter, expected",
    [
        ("trainer.nnodes=4", lambda c: c.trainer.nnodes, 4),
        ("trainer.nnodes='4'", lambda c: c.trainer.nnodes, 4),
        ("trainer.nnodes=4.0", lambda c: c.trainer.nnodes, 4),
        ("actor_rollout_ref.actor.optim.lr=1e-6", lambda c: c.actor_rollout_ref.actor.optim.lr, 1e-6),
        ("actor_rollout_ref.actor.optim.lr=3", lambda c: c.actor_rollout_ref.actor.optim.lr, 3.0),
        ("algorithm.gamma=0.99", lambda c: c.algorithm.gamma, 0.99),
        ("algorithm.use_kl_in_reward=true", lambda c: c.algorithm.use_kl_in_reward, True),
        ("algorithm.use_kl_in_reward=False", lambda c: c.algorithm.use_kl_in_reward, False),
        ("trainer.experiment_name=run-7", lambda c: c.trainer.experiment_name, "run-7"),
        ("trainer.experiment_name=123", lambda c: c.trainer.experiment_name, "123"),
        ("algorithm.adv_estimator=grpo", lambda c: c.algorithm.adv_estimator, "grpo"),
        ("trainer.total_training_steps=null", lambda c: c.trainer.total_training_steps, None),
        ("trainer.total_training_steps=10", lambda c: c.trainer.total_training_steps, 10),
        ("trainer.logger=['console','tensorboard']", lambda c: c.trainer.logger, ["console", "tensorboard"]),
        ("trainer.logger=[console,wandb]", lambda c: c.trainer.logger, ["console", "wandb"]),
        ("trainer.logger=[]", lambda c: c.trainer.logger, []),
        ("data.train_files=/d/train.parquet", lambda c: c.data.train_files, ["/d/train.parquet"]),
        ("data.train_files=[/a.parquet,/b.parquet]", lambda c: c.data.train_files, ["/a.parquet", "/b.parquet"]),
        ("actor_rollout_ref.actor.optim.betas=[0.9,0.95]", lambda c: c.actor_rollout_ref.actor.optim.betas, [0.9, 0.95]),
        ("algorithm.kl_ctrl={type: adaptive, target_kl: 0.05}", lambda c: (c.algorithm.kl_ctrl.type, c.algorithm.kl_ctrl.target_kl, c.algorithm.kl_ctrl.horizon), ("adaptive", 0.05, 10000)),
        ("+actor_rollout_ref.model.override_config.rope_theta=500000", lambda c: c.actor_rollout_ref.model.override_config, {"rope_theta": 500000}),
        ("+custom_reward_function.reward_kwargs.scale.inner=2", lambda c: c.custom_reward_function.reward_kwargs, {"scale": {"inner": 2}}),
        ("actor_rollout_ref.model.override_config={a: 1}", lambda c: c.actor_rollout_ref.model.override_config, {"a": 1}),
        ("trainer.experiment_name=a=b", lambda c: c.trainer.experiment_name, "a=b"),
    ],
)
def test_override_types(override, getter, expected):
    assert getter(load_config(None, [override])) == expected


def test_later_override_wins_and_existing_free_key_needs_no_plus():
    c = load_config(None, ["trainer.nnodes=2", "trainer.nnodes=3"])
    assert c.trainer.nnodes == 3
    c = load_config(None, ["+actor_rollout_ref.model.override_config.x=1", "actor_rollout_ref.model.override_config.x=2"])
    assert c.actor_rollout_ref.model.override_config == {"x": 2}


def test_yaml_with_includes(tmp_path):
    (tmp_path / "sub").mkdir()
    write(tmp_path / "sub" / "root.yaml", """
        trainer: {project_name: root-proj, nnodes: 8}
        algorithm: {gamma: 0.5}
    """)
    write(tmp_path / "base.yaml", """
        defaults: [sub/root.yaml]
        trainer: {nnodes: 2}
        algorithm: {lam: 0.9}
    """)
    exp = write(tmp_path / "exp.yaml", """
        defaults: [base.yaml]
        algorithm:
          adv_estimator: rloo
        trainer:
          experiment_name: exp1
    """)
    c = load_config(exp, ["trainer.nnodes=4"])
    assert c.trainer.project_name == "root-proj"  # from the include of the include
    assert c.algorithm.gamma == 0.5 and c.algorithm.lam == 0.9
    assert c.algorithm.adv_estimator == "rloo"
    assert c.trainer.experiment_name == "exp1"
    assert c.trainer.nnodes == 4  # the command line beats every file
    assert load_config(exp).trainer.nnodes == 2  # the including file beats its base


def test_include_cycle_and_missing_include(tmp_path):
    write(tmp_path / "a.yaml", "defaults: [b.yaml]\n")
    write(tmp_path / "b.yaml", "defaults: [a.yaml]\n")
    with pytest.raises(ConfigError, match="include cycle"):
        load_config(tmp_path / "a.yaml")
    write(tmp_path / "c.yaml", "defaults: [nope.yaml]\n")
    with pytest.raises(ConfigError, match=r"config file not found: .*nope.yaml \(included from .*c.yaml\)"):
        load_config(tmp_path / "c.yaml")


def test_yaml_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*missing.yaml"):
        load_config(tmp_path / "missing.yaml")
    bad = write(tmp_path / "bad.yaml", "trainer:\n  nnodes: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:.*line \d+.*invalid YAML"):
        load_config(bad)
    lst = write(tmp_path / "list.yaml", "- a\n- b\n")
    with pytest.raises(ConfigError, match="list.yaml: an experiment file must be a mapping"):
        load_config(lst)
    typo = write(tmp_path / "typo.yaml", "trainer:\n  n_gpu_per_node: 8\n")
    with pytest.raises(ConfigError) as info:
        load_config(typo)
    msg = str(info.value)
    assert "trainer.n_gpu_per_node: unknown key (did you mean 'trainer.n_gpus_per_node'?)" in msg
    assert "typo.yaml" in msg


def test_empty_yaml_is_all_defaults(tmp_path):
    assert load_config(write(tmp_path / "e.yaml", "")) == ExperimentConfig()


def test_interpolation(tmp_path):
    exp = write(tmp_path / "e.yaml", """
        trainer:
          project_name: p
          experiment_name: e
          default_local_dir: /ckpt/${trainer.project_name}/${trainer.experiment_name}
        data: {seed: 7}
    """)
    c = load_config(exp, ["trainer.seed=${data.seed}"])
    assert c.trainer.default_local_dir == "/ckpt/p/e"
    assert c.trainer.seed == 7  # a lone reference keeps the referred type
    with pytest.raises(ConfigError, match=r"trainer.experiment_name: '\$\{trainer.projct_name\}' refers to an unknown key"):
        load_config(None, ["trainer.experiment_name=${trainer.projct_name}"])


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["algorithm.adv_estimatr=grpo"], "unknown key 'algorithm.adv_estimatr' (did you mean 'algorithm.adv_estimator'?)"),
        (["trainer.adv_estimator=grpo"], "did you mean 'algorithm.adv_estimator'?"),
        (["algorithm.adv_estimator=grpoo"], "algorithm.adv_estimator: 'grpoo' is not one of 'gae', 'grpo'"),
        (["algorithm.adv_estimator=grpoo"], "(did you mean 'grpo'?)"),
        (["actor_rollout_ref.rollout.weight_update_groups=per_dp"],
         "actor_rollout_ref.rollout.weight_update_groups: 'per_dp' is not one of 'per_stage', 'per_emitter'"),
        (["trainer.nnodes=two"], "trainer.nnodes: 'two' is not an integer [from override 'trainer.nnodes=two']"),
        (["trainer.nnodes=1.5"], "trainer.nnodes: 1.5 is not an integer"),
        (["algorithm.gamma=high"], "algorithm.gamma: 'high' is not a number"),
        (["algorithm.use_kl_in_reward=maybe"], "algorithm.use_kl_in_reward: 'maybe' is not a boolean"),
        (["trainer.nnodes=null"], "trainer.nnodes: must not be null"),
        (["trainer.logger={a: 1}"], "is not a list of a string"),
        (["algorithm.kl_ctrl=3"], "algorithm.kl_ctrl: expected a group of keys"),
        (["+trainer.nnodes=2"], "'+' adds keys only inside free-form dicts; 'trainer.nnodes' is a schema key"),
        (["+trainer.brand_new=2"], "unknown key 'trainer.brand_new'"),
        (["actor_rollout_ref.model.override_config.x=1"], "add it with '+actor_rollout_ref.model.override_config.x=1'"),
        (["trainer.nnodes"], "override 'trainer.nnodes': expected key.path=value"),
        (["trainer.nnodes.x=1"], "unknown key 'trainer.nnodes.x' (did you mean 'trainer.nnodes'?)"),
        (["+actor_rollout_ref.model.override_config.a=1", "+actor_rollout_ref.model.override_config.a.b=2"],
         "'actor_rollout_ref.model.override_config.a' holds a value, not a group of keys"),
    ],
)
def test_errors_name_the_key(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert expected in str(info.value)


def test_all_errors_reported_at_once():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["trainer.nnodes=x", "algorithm.gamma=y", "trainer.nope=1"])
    msg = str(info.value)
    assert "trainer.nnodes" in msg and "algorithm.gamma" in msg and "trainer.nope" in msg


def test_to_yaml_round_trips(tmp_path):
    c = load_and_validate(None, [
        "data.train_files=/x.parquet", "actor_rollout_ref.model.path=/m", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4", "+actor_rollout_ref.model.override_config.k=[1,2]",
    ])
    text = to_yaml(c)
    tree = yaml.safe_load(text)
    assert tree["algorithm"]["adv_estimator"] == "grpo"  # nested, not dotted
    again = load_config(write(tmp_path / "shown.yaml", text))
    assert again == c
