"""The options of verl 0.9.1's policy loss modes at load time (actor.policy_loss.*, actor.tau_pos /
tau_neg): refused where the mode in use cannot work with them, naming the key; not read by the
other modes (as in verl); the modes that aggregate their own way say so; `megarl config show`
prints them under verl's names."""
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from config_cases import REQUIRED, fails, ok

REPO = Path(__file__).resolve().parents[2]
ACTOR = "actor_rollout_ref.actor"
PL = f"{ACTOR}.policy_loss"


@pytest.mark.parametrize("overrides, expected", [
    ([f"{PL}.loss_mode=sapo", f"{ACTOR}.tau_pos=0"], f"{ACTOR}.tau_pos=0.0: SAPO's gate temperature must be > 0"),
    ([f"{PL}.loss_mode=sapo", f"{ACTOR}.tau_neg=-1.0"], f"{ACTOR}.tau_neg=-1.0: SAPO's gate temperature must be > 0"),
    ([f"{PL}.loss_mode=clip_cov", f"{PL}.clip_cov_ratio=0"], f"{PL}.clip_cov_ratio=0.0: must be > 0"),
    ([f"{PL}.loss_mode=kl_cov", f"{PL}.kl_cov_ratio=0"], f"{PL}.kl_cov_ratio=0.0: the share of tokens penalised"),
    ([f"{PL}.loss_mode=kl_cov", f"{PL}.kl_cov_ratio=1.5"], f"{PL}.kl_cov_ratio=1.5: the share of tokens penalised"),
    ([f"{PL}.loss_mode=kl_cov", f"{PL}.ppo_kl_coef=-0.1"], f"{PL}.ppo_kl_coef=-0.1: a penalty coefficient must be"),
    ([f"{PL}.loss_mode=dro"], f"{PL}.dro_beta=None: DRO needs the penalty's coefficient, > 0 ({PL}.loss_mode=dro)"),
    ([f"{PL}.loss_mode=dro", f"{PL}.dro_beta=0"], f"{PL}.dro_beta=0.0: DRO needs"),
    ([f"{PL}.loss_mode=ppo"], f"{PL}.loss_mode"),
    ([f"{PL}.clip_cov_ratio=fast"], f"{PL}.clip_cov_ratio"),
])
def test_a_bad_option_of_the_mode_in_use_is_refused_naming_its_key(overrides, expected):
    assert expected in fails(*overrides)


def test_the_options_of_modes_not_in_use_are_not_read_as_in_verl():
    config = ok(f"{ACTOR}.tau_pos=0", f"{PL}.clip_cov_ratio=0", f"{PL}.kl_cov_ratio=2", f"{PL}.ppo_kl_coef=-1")
    assert config.actor_rollout_ref.actor.policy_loss.dro_beta is None  # dro's is required with dro only
    ok(f"{PL}.loss_mode=dro", f"{PL}.dro_beta=0.1", f"{PL}.kl_cov_ratio=2")


@pytest.mark.parametrize("overrides, warned", [
    ([f"{PL}.loss_mode=sapo"], "aggregates the policy loss by seq-mean-token-mean"),
    ([f"{PL}.loss_mode=sapo", f"{ACTOR}.loss_agg_mode=seq-mean-token-mean"], None),
    ([f"{PL}.loss_mode=geo_mean", f"{ACTOR}.loss_agg_mode=seq-mean-token-mean"],
     "aggregates the policy loss by the mean over responses"),
    ([f"{PL}.loss_mode=cispo"], None),
])
def test_the_modes_that_aggregate_their_own_way_say_so(caplog, overrides, warned):
    with caplog.at_level(logging.WARNING, logger="megarl.config"):
        ok(*overrides)
    messages = [r.getMessage() for r in caplog.records if "aggregates the policy loss" in r.getMessage()]
    assert ([warned in m for m in messages] == [True]) if warned else messages == []


def test_config_show_prints_the_options_under_verls_names(tmp_path):
    r = subprocess.run([sys.executable, "-m", "megarl.cli", "config", "show", *REQUIRED, f"{PL}.loss_mode=kl_cov",
                        f"{PL}.kl_cov_ratio=0.01", f"{ACTOR}.tau_neg=1.2"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    actor = yaml.safe_load(r.stdout)["actor_rollout_ref"]["actor"]
    assert actor["policy_loss"] == {"loss_mode": "kl_cov", "clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0,
                                    "clip_cov_ub": 5.0, "kl_cov_ratio": 0.01, "ppo_kl_coef": 0.1, "dro_beta": None}
    assert (actor["tau_pos"], actor["tau_neg"]) == (1.0, 1.2)


def test_clip_ratio_alone_warns_that_verl_would_clip_at_its_defaults(caplog):
    """verl 0.9.1's actor.yaml sets clip_ratio_low / clip_ratio_high to 0.2 and its vanilla loss reads them
    before clip_ratio (core_algos.py compute_policy_loss_vanilla): clip_ratio alone changes nothing there."""
    with caplog.at_level(logging.WARNING, "megarl.config"):
        ok("actor_rollout_ref.actor.clip_ratio=0.1")
        ok("actor_rollout_ref.actor.clip_ratio=0.1", "actor_rollout_ref.actor.clip_ratio_low=0.1",
           "actor_rollout_ref.actor.clip_ratio_high=0.1")
        ok("actor_rollout_ref.actor.clip_ratio_high=0.28")
    warned = [r.getMessage() for r in caplog.records if "verl 0.9.1 would clip at 0.2" in r.getMessage()]
    assert len(warned) == 1
    assert warned[0].startswith("actor_rollout_ref.actor.clip_ratio=0.1 without actor_rollout_ref.actor.clip_ratio_low"
                                " / clip_ratio_high: megarl clips at 0.1 there")
