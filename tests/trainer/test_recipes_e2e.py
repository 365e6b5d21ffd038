"""Every tiny RL recipe (configs/tiny/*.yaml) end to end on CPU, checking that what makes the
algorithm that algorithm actually happened in the loop.

One Ray session serves all recipes; each recipe brings up its own cluster (real megatron-core on
gloo, CPU-engine rollout servers behind the router; the four estimators whose clusters would be the
same share one: `TestEstimatorsShareOneCluster`), runs one `RLTrainer.train_step` and is
inspected through the step's metrics and the batch the actor was updated on (captured on its way
into `EngineGroup.update` or `update_and_compute`). The algorithm tests run the recipes' own small
layout (one logical GPU: TP=1, one server); the tests of what a layout changes (a critic at TP=2,
the tensor transport's per-rank copies, TP-sharded LoRA adapters, routing replay over DP ranks) set
theirs (`TWO_GPUS_TP2`, `TWO_GPUS_DP2`).

The reward is this file's `first_char_is_digit`: about one response in five of the random tiny model
starts with a digit, so groups of four responses are a mix of informative groups and groups whose
responses all score the same, which the group estimators and DAPO's filter must tell apart.
"""
import dataclasses
import math
import os
import random
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
import torch
from transformers import AutoTokenizer

from megarl.config import load_and_validate
from megarl.data.batch import Batch
from megarl.runtime.cluster import Cluster
from megarl.trainer.rl import RLTrainer

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]

GPUS = 2  # logical GPUs of the Ray session: the configs/tiny recipes use 1, the layouts below 2
# The layout every configs/tiny recipe had before they moved to one GPU (issue 28): actor TP=2 on two
# logical GPUs, two colocated rollout servers.
TWO_GPUS_TP2 = ("trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2")
TWO_GPUS_DP2 = ("trainer.n_gpus_per_node=2",)  # with a TP=1 recipe: actor DP=2, two colocated servers
TOL = 1e-5


def first_char_is_digit(data_source, solution_str, ground_truth, extra_info=None):
    """1 when the response starts with a digit, else 0; `acc` is DAPO's filter metric."""
    acc = float(solution_str[:1].isdigit())
    return {"score": acc, "acc": acc}


@pytest.fixture(scope="module")
def ray_session():
    import ray  # after megarl.runtime.cluster, which sets Ray's auth default for a local cluster

    # address="local": a Ray of our own even when another cluster runs on this machine
    ray.init(address="local", num_cpus=max(2, os.cpu_count() or 2), num_gpus=GPUS, include_dashboard=False,
             log_to_driver=False, logging_level="WARNING")
    yield
    ray.shutdown()


@dataclass
class StepRecord:
    config: object
    metrics: dict
    actor_batches: list = field(default_factory=list)  # the batch of each actor update
    critic_batches: list = field(default_factory=list)
    values_after: torch.Tensor | None = None  # PPO: the critic's values of the batch after its update


def recipe_config(name: str, tiny: Path, out: Path, *overrides: str):
    """configs/tiny/<name>.yaml on the `tiny_assets` model and data, writing under `out`."""
    paths = [f"actor_rollout_ref.model.path={tiny / 'model'}", f"data.train_files={tiny / 'data/train.parquet'}",
             f"data.val_files={tiny / 'data/val.parquet'}", f"trainer.default_local_dir={out}"]
    return load_and_validate(REPO / f"configs/tiny/{name}.yaml", [*paths, *overrides])


def run_recipe(name: str, tiny: Path, out: Path, *overrides: str, steps: int = 1,
               cluster: Cluster | None = None) -> StepRecord:
    """Bring up configs/tiny/<name>.yaml's cluster on the `tiny_assets` model and data, run
    `steps` train_steps (metrics: the last one's), tear it down. With `cluster` (a shared one, see
    `TestEstimatorsShareOneCluster`): the steps run on it, left up."""
    config = recipe_config(name, tiny, out, *overrides)
    tokenizer = AutoTokenizer.from_pretrained(tiny / "model")
    shared = cluster is not None
    if shared:
        differing = config_differences(config, cluster.config)
        assert differing <= CLUSTER_BLIND, f"{name}: the shared cluster's config differs in {differing - CLUSTER_BLIND}"
    else:
        cluster = Cluster(config)
    restore = []
    try:
        trainer = RLTrainer(config, cluster, tokenizer, first_char_is_digit)
        record = StepRecord(config, {})
        restore.append(_capture_updates(cluster.actor, record.actor_batches))
        if cluster.critic is not None:
            restore.append(_capture_updates(cluster.critic, record.critic_batches))
        for _ in range(steps):
            record.metrics = trainer.train_step()
        if cluster.critic is not None and record.critic_batches:
            record.values_after = cluster.critic.compute_values(record.critic_batches[0])["values"]
    finally:
        for undo in restore:
            undo()
        if not shared:
            cluster.shutdown()
    for key, value in record.metrics.items():
        assert math.isfinite(value), f"{name}: {key}={value}"
    assert len(record.actor_batches) == steps, f"{name}: the actor was updated {len(record.actor_batches)} times"
    if record.config.actor_rollout_ref.rollout.dtype == "float32":  # the CPU engine scores as the actor does
        assert record.metrics["training/rollout_log_probs_diff_max"] < 1e-4, record.metrics
    return record


# The keys in which a recipe's config may differ from a shared cluster's: the estimator, read by the
# controller (RLTrainer) alone, never by Cluster or its workers (of algorithm.*, they read
# rollout_correction, dpo, and use_kl_in_reward for the placement of a reference), and where logs go
# (trainer.default_local_dir / experiment_name: the servers' log directory).
CLUSTER_BLIND = {"algorithm.adv_estimator", "trainer.experiment_name", "trainer.default_local_dir"}


def config_differences(a, b) -> set[str]:
    """The dotted keys whose values differ between two configs."""
    def flat(tree, prefix=""):
        if not isinstance(tree, dict):
            return {prefix[:-1]: tree}
        return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}{key}.").items()}

    fa, fb = flat(dataclasses.asdict(a)), flat(dataclasses.asdict(b))
    return {key for key in fa.keys() | fb.keys() if fa.get(key) != fb.get(key)}


def _capture_updates(group, sink: list):
    """Record the batch of each update (an actor whose update makes its old log-probs gets them
    in the recorded batch from the controller right after); returns the undo."""
    names = ("update", "update_and_compute")
    own = {name: group.__dict__[name] for name in names if name in group.__dict__}
    for name in names:
        setattr(group, name, _recording(getattr(group, name), sink))

    def undo():
        for name in names:
            if name in own:
                setattr(group, name, own[name])
            else:
                delattr(group, name)

    return undo


def _recording(update, sink: list):
    def recording(method: str, batch: Batch):
        sink.append(batch)
        return update(method, batch)

    return recording


# ------------------------------------------------------------------------------ batch views
def seq_rewards(batch: Batch) -> torch.Tensor:
    """Each response's total token-level reward (score + KL penalty where configured), float64 [B]."""
    return (batch["token_level_rewards"].double() * batch["response_mask"]).sum(-1)


def per_response(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, R] values that are constant over each response's tokens -> [B]; asserts the constancy."""
    mask = mask.bool()
    out = []
    for row, m in zip(values.double(), mask):
        tokens = row[m]
        assert torch.allclose(tokens, tokens[0].expand_as(tokens), atol=TOL), f"not constant over a response: {tokens}"
        out.append(tokens[0])
    return torch.stack(out)


def groups(uids) -> list[list[int]]:
    members: dict = {}
    for i, uid in enumerate(uids):
        members.setdefault(uid, []).append(i)
    return list(members.values())


def reversed_cumsum(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """returns_t = sum_{k >= t} r_k over valid tokens (gamma 1), 0 on padding."""
    r = torch.where(mask.bool(), rewards.double(), 0.0)
    return torch.where(mask.bool(), r.flip(-1).cumsum(-1).flip(-1), 0.0)


def whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x - mean) / std over valid positions (unbiased variance), 0 on padding."""
    valid = x[mask.bool()]
    return torch.where(mask.bool(), (x - valid.mean()) / torch.sqrt(valid.var() + 1e-8), 0.0)


def informative(batch: Batch) -> list[list[int]]:
    scores = seq_rewards(batch)
    return [g for g in groups(batch["uid"]) if len({scores[i].item() for i in g}) > 1]


# ------------------------------------------------------------------------------ the recipes
def test_ppo_critic_values_and_gae(ray_session, tiny_assets, tmp_path):
    # the layout this recipe had before issue 28: actor and critic at TP=2, two servers
    run = run_recipe("ppo", tiny_assets, tmp_path, *TWO_GPUS_TP2, "critic.megatron.tensor_model_parallel_size=2")
    assert run.config.critic.megatron.tensor_model_parallel_size == 2
    batch, m = run.actor_batches[0], run.metrics
    assert "values" in batch and batch["values"].shape == batch["response_mask"].shape
    assert len(run.critic_batches) == 1 and m["timing/update_critic_s"] > 0 and m["timing/values_s"] > 0
    assert "critic/vf_loss" in m and "critic/vf_clipfrac" in m
    mask = batch["response_mask"].bool()
    # gamma = lam = 1: GAE's returns (the critic's targets) are the reward-to-go
    assert torch.allclose(batch["returns"].double()[mask], reversed_cumsum(batch["token_level_rewards"], mask)[mask],
                          atol=TOL)
    adv = batch["advantages"][mask]
    assert abs(adv.mean().item()) < 1e-4 and abs(adv.std().item() - 1) < 1e-3  # whitened over the batch
    # the critic learned: its values of the same batch moved after the update
    assert not torch.allclose(run.values_after[mask], batch["values"][mask])


def test_grpo_family_dr_grpo_does_not_divide_by_std(ray_session, tiny_assets, tmp_path):
    run = run_recipe("dr_grpo", tiny_assets, tmp_path)
    batch = run.actor_batches[0]
    assert run.config.actor_rollout_ref.actor.loss_agg_mode == "seq-mean-token-sum-norm"
    adv = per_response(batch["advantages"], batch["response_mask"])
    scores = seq_rewards(batch)
    useful = informative(batch)
    assert useful, "no group had different scores: the check would be vacuous"
    for g in groups(batch["uid"]):
        expected = scores[g] - scores[g].mean()
        assert torch.allclose(adv[g], expected, atol=TOL), (adv[g], expected)
    g = useful[0]  # with GRPO's normalisation these would differ
    assert not torch.allclose(adv[g], (scores[g] - scores[g].mean()) / (scores[g].std() + 1e-6), atol=1e-3)
    assert_token_ratio_identity(run.metrics, "dr_grpo")


def assert_token_ratio_identity(m: dict, name: str) -> None:
    """With token-level ratios r = exp(l), mean(r) = 1 + mean(expm1(l) - l) + mean(l), i.e.
    ratio_mean = 1 + approx_kl - ppo_kl, in every mini-batch and so in their average."""
    gap = m["actor/ratio_mean"] - 1 - m["actor/approx_kl"] + m["actor/ppo_kl"]
    assert abs(gap) < 1e-6, f"{name}: token-ratio identity off by {gap}"


def test_gspo_uses_sequence_level_ratios(ray_session, tiny_assets, tmp_path):
    run = run_recipe("gspo", tiny_assets, tmp_path)
    m = run.metrics
    assert run.config.actor_rollout_ref.actor.policy_loss.loss_mode == "gspo"
    # four mini-batches: after the first update the policy has moved, so the ratios differ from 1
    assert m["actor/approx_kl"] > 0
    # The loss's ratio is exp(mean_t l_t) per response; by Jensen it is below the token ratios'
    # mean (the identity of assert_token_ratio_identity), strictly when the tokens' log-ratios vary.
    gap = m["actor/ratio_mean"] - 1 - m["actor/approx_kl"] + m["actor/ppo_kl"]
    assert gap < -1e-6, f"ratio_mean is the token ratios' mean (gap {gap}): the sequence-level path did not run"
    assert m["actor/pg_clipfrac_dual"] == 0.0  # GSPO has no dual clip
    assert m["actor/pg_clipfrac"] > 0  # the 3e-4 / 4e-4 range clips whole responses once the policy moved


def test_gpg_estimator_and_loss(ray_session, tiny_assets, tmp_path):
    """verl's GPG keys on the GRPO recipe: each response's advantage is alpha (s_i - mean_g), alpha =
    responses / responses with a nonzero score, and the loss has no clip."""
    run = run_recipe("grpo", tiny_assets, tmp_path, "algorithm.adv_estimator=gpg",
                     "actor_rollout_ref.actor.policy_loss.loss_mode=gpg")
    batch, m = run.actor_batches[-1], run.metrics
    adv, scores = per_response(batch["advantages"], batch["response_mask"]), seq_rewards(batch)
    assert informative(batch), "no group had different scores: the check would be vacuous"
    alpha = len(scores) / max(int(scores.count_nonzero()), 1)
    for g in groups(batch["uid"]):
        assert torch.allclose(adv[g], alpha * (scores[g] - scores[g].mean()), atol=TOL), (adv[g], scores[g])
    assert "actor/pg_clipfrac" not in m and math.isfinite(m["actor/pg_loss"])
    assert m["actor/approx_kl"] > 0  # the second mini-batch's ratios: the first one's update moved the policy


def test_dapo_filter_clip_higher_and_overlong(ray_session, tiny_assets, tmp_path):
    run = run_recipe("dapo", tiny_assets, tmp_path)
    batch, m, c = run.actor_batches[0], run.metrics, run.config
    # dynamic sampling: all-equal groups were dropped and more prompts generated to fill the batch
    target = c.data.train_batch_size
    assert m["dynamic_sampling/kept_groups"] == target
    assert m["dynamic_sampling/seen_groups"] > target, m
    # each round generated data.gen_batch_size prompts; groups past the target were dropped
    assert c.data.gen_batch_size == 12
    assert m["dynamic_sampling/seen_groups"] == m["dynamic_sampling/rounds"] * c.data.gen_batch_size, m
    assert len(groups(batch["uid"])) == target and len(batch) == target * c.actor_rollout_ref.rollout.n
    for g in groups(batch["uid"]):
        assert len({batch["acc"][i] for i in g}) > 1, f"an all-equal group was kept: {[batch['acc'][i] for i in g]}"
    # overlong shaping: score = acc + penalty of the length beyond max_response_length - buffer
    rm = c.reward_model
    lengths = batch["response_mask"].sum(-1).float()
    penalty = torch.clamp(-(lengths - (c.data.max_response_length - rm.overlong_buffer_len))
                          / rm.overlong_buffer_len * rm.overlong_penalty_factor, max=0.0)
    assert torch.allclose(batch["scores"], torch.tensor(batch["acc"]) + penalty, atol=TOL)
    assert (penalty < 0).any(), "no response reached the overlong buffer: the check would be vacuous"
    assert m["reward/overlong_penalty_mean"] <= 0
    # clip-higher: decoupled bounds reach the loss, which reports the share clipped at each bound
    assert (c.actor_rollout_ref.actor.clip_ratio_low, c.actor_rollout_ref.actor.clip_ratio_high) == (0.2, 0.28)
    for key in ("actor/pg_clipfrac_high", "actor/pg_clipfrac_low", "actor/pg_clipfrac"):
        assert 0.0 <= m[key] <= 1.0, key
    assert_token_ratio_identity(m, "dapo")


@pytest.fixture(scope="class")
def shared(ray_session, tiny_assets, tmp_path_factory):
    """configs/tiny/rloo.yaml's cluster, up while the tests of one class run (torn down before the
    next tests, which need the Ray session's GPUs)."""
    cluster = Cluster(recipe_config("rloo", tiny_assets, tmp_path_factory.mktemp("estimators")))
    try:
        yield cluster
    finally:
        cluster.shutdown()


class TestEstimatorsShareOneCluster:
    """RLOO, ReMax, REINFORCE++ and REINFORCE++ with a baseline: recipes that differ from each other only
    in what the controller reads (the estimator; `CLUSTER_BLIND`, checked by run_recipe), so
    their clusters would be the same: one serves the four tests (a cluster start is ~13 s, a step
    ~0.3 s), each running its own recipe's RLTrainer on it. Each test's checks are of its own batch
    against its own scores and rewards, whatever the policy the previous tests' updates left."""

    def test_rloo_baseline_leaves_the_sample_out(self, shared, tiny_assets, tmp_path):
        run = run_recipe("rloo", tiny_assets, tmp_path, cluster=shared)
        batch = run.actor_batches[0]
        assert "critic/kl" in run.metrics  # KL as a reward penalty
        adv = per_response(batch["advantages"], batch["response_mask"])
        scores = seq_rewards(batch)
        assert informative(batch), "no group had different scores: the check would be vacuous"
        for g in groups(batch["uid"]):
            for i in g:
                others = [scores[j] for j in g if j != i]
                expected = scores[i] - sum(others) / len(others)
                assert abs(adv[i].item() - expected.item()) < TOL, (i, adv[i], expected)

    def test_remax_greedy_baseline(self, shared, tiny_assets, tmp_path):
        run = run_recipe("remax", tiny_assets, tmp_path, cluster=shared)
        batch, m = run.actor_batches[0], run.metrics
        assert "reward_baselines" in batch
        baselines = batch["reward_baselines"]
        assert baselines.shape == (len(batch),)
        for g in groups(batch["uid"]):  # one greedy response per prompt
            assert torch.all(baselines[g] == baselines[g[0]])
        assert abs(m["reward/remax_baseline_mean"] - baselines.mean().item()) < TOL
        mask = batch["response_mask"].bool()
        expected = reversed_cumsum(batch["token_level_rewards"], mask) - baselines.double()[:, None]
        assert torch.allclose(batch["advantages"].double()[mask], expected[mask], atol=TOL)

    def test_reinforce_pp_whitens_over_the_batch(self, shared, tiny_assets, tmp_path):
        run = run_recipe("reinforce_pp", tiny_assets, tmp_path, cluster=shared)
        batch = run.actor_batches[0]
        mask = batch["response_mask"].bool()
        expected = whiten(reversed_cumsum(batch["token_level_rewards"], mask), mask)
        assert torch.allclose(batch["advantages"].double()[mask], expected[mask], atol=1e-4)
        adv = batch["advantages"][mask]
        assert abs(adv.mean().item()) < 1e-4 and abs(adv.std().item() - 1) < 1e-3

    def test_reinforce_pp_baseline_centres_per_group_then_whitens(self, shared, tiny_assets, tmp_path):
        run = run_recipe("reinforce_pp_baseline", tiny_assets, tmp_path, cluster=shared)
        batch = run.actor_batches[0]
        mask = batch["response_mask"].bool()
        scores = seq_rewards(batch)
        centred = torch.zeros_like(scores)
        degenerate = torch.zeros(len(batch), dtype=torch.bool)
        for g in groups(batch["uid"]):
            if len({scores[i].item() for i in g}) > 1:
                centred[g] = scores[g] - scores[g].mean()
            else:
                degenerate[g] = True
        assert not degenerate.all(), "no group had different scores: the check would be vacuous"
        expected = whiten(torch.where(mask, centred[:, None], 0.0), mask)
        expected = torch.where(degenerate[:, None], 0.0, expected)
        assert torch.allclose(batch["advantages"].double()[mask], expected[mask], atol=1e-4)


RC = "algorithm.rollout_correction"


@pytest.mark.parametrize("correction", [
    ["actor_rollout_ref.actor.tis_imp_ratio_cap=1.002"],
    [f"{RC}.rollout_is=sequence", f"{RC}.rollout_is_threshold=1.01", f"{RC}.rollout_rs=token_k1",
     f"{RC}.rollout_rs_threshold=0.998_1.002"],
], ids=["tis_imp_ratio_cap", "rollout_correction"])
def test_rollout_corrections_correct_a_bf16_rollout(ray_session, tiny_assets, tmp_path, correction):
    """The rollout servers sample in bfloat16 while the actor trains in float32: their log-probs
    differ (rho = exp(old - rollout) of 0.996-1.0045 per token). With tis_imp_ratio_cap each token's
    loss is weighted by min(rho, cap) inside the update; with verl's algorithm.rollout_correction the
    controller gives the update sequence weights min(prod_t rho_t, 1.01) and drops the tokens whose
    rho leaves [0.998, 1.002] before the advantages, which then leave the update's token count too
    (one mini-batch of one micro-batch, so the logged values are the batch's). Either way verl's
    off-policy diagnostics are logged (rollout_corr/kl: the mean of rollout - trainer log-probs)."""
    run = run_recipe("grpo", tiny_assets, tmp_path, "actor_rollout_ref.rollout.dtype=bfloat16", *correction,
                     "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32")
    batch, m = run.actor_batches[0], run.metrics
    mask = batch.response_tokens().bool()
    assert m["training/rollout_log_probs_diff_max"] > 1e-3, m  # bf16 sampling is visibly off the trainer
    log_ratio = (batch["old_log_probs"] - batch["rollout_log_probs"]).double()
    rho = torch.exp(log_ratio)
    assert m["rollout_corr/kl"] == pytest.approx(-log_ratio[mask].mean().item(), abs=1e-7)
    if correction[0].startswith("actor_rollout_ref"):
        raw = rho[mask]
        assert abs(m["actor/tis_weight_mean"] - raw.clamp(max=1.002).mean().item()) < 1e-5, m
        assert m["actor/tis_capfrac"] == pytest.approx((raw > 1.002).float().mean().item(), abs=1e-6)
        assert 0 < m["actor/tis_capfrac"] < 1, "the cap should bind on some tokens (bf16 weights: 0.996-1.0045)"
        assert not any(key.startswith(("rollout_corr/rollout_is", "rollout_corr/rollout_rs")) for key in m)
        return
    keep = mask & (rho >= 0.998) & (rho <= 1.002)
    assert torch.equal(batch["response_mask"].bool(), keep)
    assert torch.all(batch["advantages"][mask & ~keep] == 0)  # the advantages were made on the kept tokens
    dropped = 1 - keep.sum().item() / mask.sum().item()
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(dropped)
    assert 0 < dropped < 1, "the band should drop some tokens and keep others"
    seq_dropped = (mask & ~keep).any(1).float().mean().item()
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(seq_dropped)
    assert m["actor/tokens"] == keep.sum().item()  # the dropped tokens left the update's count
    seq = torch.exp(torch.where(mask, log_ratio, 0.0).sum(1))  # each response's product of rho
    assert batch["rollout_is_weights"].double()[mask].tolist() == pytest.approx(
        seq.clamp(max=1.01)[:, None].expand_as(mask)[mask].tolist(), abs=1e-6)
    assert m["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx((seq > 1.01).double().mean().item())
    assert "actor/tis_weight_mean" not in m


def hf_log_probs(model_dir: Path, batch: Batch) -> torch.Tensor:
    """[B, R] float64: each response token's log-prob under the HF model at temperature 1, 0 at padding."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = torch.zeros(batch["response_ids"].shape, dtype=torch.float64)
    with torch.no_grad():
        for i in range(len(batch)):
            prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()]
            n = int(batch.response_tokens()[i].sum())
            response = batch["response_ids"][i, :n]
            logits = model(input_ids=torch.cat([prompt, response])[None]).logits[0, len(prompt) - 1:-1]
            out[i, :n] = torch.log_softmax(logits.double(), -1).gather(1, response[:, None])[:, 0]
    return out


def test_bypass_mode_uses_the_rollouts_log_probs_and_corrects_in_the_loss(ray_session, tiny_assets, tmp_path):
    """verl's bypass mode (bypass_pg_geo_rs_seq_tis-like: REINFORCE with sequence TIS weights and a
    token band, bf16 rollouts): no trainer log-prob pass, the rollout's log-probs are the old ones,
    the batch reaches the actor unmasked and unweighted, and the loss makes the corrections from the
    current policy, logged under verl's names (rollout_corr/...). One mini-batch of one micro-batch:
    the current policy is the initial model, so the logged diagnostics are those of the HF model's
    log-probs of the batch against the rollout's (megarl.algos.rollout_correction, whose parity
    with verl's code tests/algos/test_rollout_correction_verl.py checks)."""
    from megarl.algos.rollout_correction import offpolicy_metrics, rollout_correction

    run = run_recipe("grpo", tiny_assets, tmp_path, "actor_rollout_ref.rollout.dtype=bfloat16",
                     f"{RC}.bypass_mode=true", f"{RC}.loss_type=reinforce", f"{RC}.rollout_is=sequence",
                     f"{RC}.rollout_is_threshold=1.01", f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold=0.998_1.002",
                     "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32")
    batch, m = run.actor_batches[0], run.metrics
    mask = batch.response_tokens()
    assert "timing/old_log_prob_s" not in m and "training/rollout_log_probs_diff_max" not in m
    assert torch.equal(batch["old_log_probs"], batch["rollout_log_probs"])
    assert torch.equal(batch["response_mask"], mask) and "rollout_is_weights" not in batch
    assert m["actor/tokens"] == mask.sum().item()  # the loss's rejections keep the mini-batch's counts, as verl
    assert "actor/pg_clipfrac" not in m  # REINFORCE: no clipping
    assert not any(key.startswith("actor/rollout_corr") for key in m)
    current = hf_log_probs(tiny_assets / "model", batch)
    _, keep, expected = rollout_correction(current, batch["rollout_log_probs"], mask, rollout_is="sequence",
                                           is_upper=1.01, rejection=[("token_k1", 0.998, 1.002)])
    expected.update(offpolicy_metrics(current, batch["rollout_log_probs"], mask))
    assert 0 < keep.sum() < mask.sum(), "the band should drop some tokens and keep others"
    for name in ("rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/training_ppl", "rollout_corr/chi2_token",
                 "rollout_corr/rollout_is_mean", "rollout_corr/rollout_is_max", "rollout_corr/rollout_rs_token_k1_mean"):
        assert m[name] == pytest.approx(expected[name], abs=1e-5), name
    assert abs(m["rollout_corr/rollout_rs_masked_fraction"] - expected["rollout_corr/rollout_rs_masked_fraction"]) <= 2 / mask.sum()


# ------------------------------------------------------------------------------ agent episodes
@pytest.fixture(scope="module")
def sft_model(tiny_assets, tmp_path_factory) -> Path:
    """The tiny model after a short SFT on the addition task (plain HF training on one thread, 240
    steps of 128 examples, lr 2e-3; ~30 core-seconds), half of the examples in the calculator's
    second-turn form (question, a wrong answer, the tool's hint, the question again -> the answer),
    so that some episodes succeed in their second turn: sampled at temperature 1, ~5% right first
    answers and ~6% right second answers, 14-19 second-turn successes in 256 episodes (the test's two
    steps of 16 x 8) over three sampling seeds and two SFT seeds (measured by HF sampling of the
    episode's two calls; 480 steps at lr 1e-3 gave ~60 for twice the time, 120 steps or lr 3e-3 ~3).
    Test setup, not under test."""
    from transformers import AutoModelForCausalLM

    from megarl.data.synthetic import TASKS, distinct_examples

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(tiny_assets / "model")
    model = AutoModelForCausalLM.from_pretrained(tiny_assets / "model", dtype=torch.float32)
    examples = distinct_examples(TASKS["add"], 4096, random.Random(1))
    wrong_answers = random.Random(2)

    def chars(text: str) -> list[int]:
        return tokenizer.convert_tokens_to_ids(list(text))

    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small gains little from a second thread, which costs core time
    try:
        for step in range(240):
            rows = []
            for k, (question, answer) in enumerate(examples[(step * 128) % 4096:][:128]):
                prompt = [tokenizer.bos_token_id, *chars(question)]
                if k % 2:  # as calculator.py's second call renders it (the tiny chat template)
                    prompt += [*chars(str(wrong_answers.randrange(10, 200))), tokenizer.eos_token_id,
                               *chars("?" + answer[0] + question)]
                target = [*chars(answer), tokenizer.eos_token_id]
                rows.append((prompt + target, [0] * len(prompt) + [1] * len(target)))
            width = max(len(ids) for ids, _ in rows)
            ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids)) for ids, _ in rows])
            trained = torch.tensor([m + [0] * (width - len(m)) for _, m in rows])[:, 1:]
            log_probs = torch.log_softmax(model(input_ids=ids).logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
            loss = -(log_probs * trained).sum() / trained.sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    out = tmp_path_factory.mktemp("sft") / "model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_agent_reinforce_pp_credits_the_first_turn_of_a_successful_episode(ray_session, tiny_assets, sft_model,
                                                                            tmp_path):
    """configs/tiny/agent_calculator.yaml with REINFORCE++: the tool's reply sits inside the response
    with mask 0, and the episode's score on its last token. A right second answer (score 0.5) must
    credit the first turn too: the return runs across the masked reply, so the first turn's
    advantage equals the second turn's (gamma 1, no KL in the reward) and is above what a return of 0
    whitens to in the same batch (an uncredited first turn's). Not "above 0": whitening subtracts the
    batch's mean return, which a batch with many first-turn successes (score 1) puts above 0.5."""
    run = run_recipe("agent_calculator", tiny_assets, tmp_path, f"actor_rollout_ref.model.path={sft_model}",
                     f"actor_rollout_ref.rollout.agent.path={REPO / 'examples/agents/calculator.py'}",
                     "algorithm.adv_estimator=reinforce_plus_plus", steps=2)
    assert run.config.algorithm.gamma == 1.0 and not run.config.algorithm.use_kl_in_reward
    seen = 0
    for batch in run.actor_batches:
        mask = batch["response_mask"].bool()
        returns = reversed_cumsum(batch["token_level_rewards"], mask)
        assert torch.allclose(batch["advantages"].double()[mask], whiten(returns, mask)[mask], atol=1e-4)
        valid = returns[mask]
        uncredited = (-valid.mean() / torch.sqrt(valid.var() + 1e-8)).item()  # a return of 0, whitened
        for row in range(len(batch)):
            present = batch["response_attention_mask"][row].bool()
            policy = mask[row][present]
            gap = (~policy).nonzero()
            if len(gap) == 0 or abs(seq_rewards(batch)[row].item() - 0.5) > 1e-9:
                continue  # not a two-turn episode that succeeded in its second turn
            first_turn = batch["advantages"][row][present][: gap[0].item()]
            second_turn = batch["advantages"][row][present][gap[-1].item() + 1:]
            assert len(first_turn) and (first_turn > uncredited + 1e-3).all(), (row, first_turn, uncredited)
            assert torch.allclose(first_turn, second_turn[:1].expand_as(first_turn), atol=1e-6)
            seen += 1
    assert seen > 0, "no episode succeeded in its second turn: the check would be vacuous"


# ------------------------------------------------------------------------------ weight-sync transports
def test_grpo_with_the_tensor_transport_serves_the_pushed_weights(ray_session, tiny_assets, tmp_path):
    """Colocated on CPU, `weight_sync_transport=tensor` shares each bucket with the CPU engine through
    shared memory (`/update_weights_from_tensor`, SGLang's request shape). Step 2 generates with the
    weights pushed after step 1's update: the servers' log-probs of what they sampled equal the
    actor's (run_recipe's check, < 1e-4 in fp32), so the pushed weights are the actor's. At TP=2 with
    two servers: each actor rank copies for the server on its GPU."""
    run = run_recipe("grpo", tiny_assets, tmp_path, *TWO_GPUS_TP2, "actor_rollout_ref.rollout.weight_sync_transport=tensor",
                     steps=2)
    assert run.config.actor_rollout_ref.rollout.weight_sync_transport == "tensor"
    m = run.metrics
    assert m["sync/bytes"] > 0 and m["sync/weight_version"] == 2, m
    assert m["actor/grad_norm"] > 0  # step 2's samples came from weights that step 1 changed


def test_grpo_with_batched_requests_sends_each_server_its_prompts_in_one_request(ray_session, tiny_assets, tmp_path,
                                                                               monkeypatch):
    """`rollout.batch_requests_per_server` in the quickstart's layout (actor DP=2, two colocated
    servers): the step's 8 prompts go out as one /generate per server, straight to it (recorded at
    aiohttp's own method in this process, the controller's), prompt i to server i % 2, and the
    samples come back with the actor's log-probs (run_recipe's check, < 1e-4 in fp32), which a
    response paired with another prompt would not have. That a batch samples what a request per
    prompt samples: tests/rollout/test_cpu_server.py."""
    posts = []
    request = aiohttp.ClientSession._request

    async def recorded(self, method, url, **kwargs):
        if str(url).endswith("/generate"):
            posts.append((str(url), kwargs["json"]["input_ids"]))
        return await request(self, method, url, **kwargs)

    monkeypatch.setattr(aiohttp.ClientSession, "_request", recorded)
    # balance_batch off: the actor's batch then keeps the order the prompts were generated in
    run = run_recipe("grpo", tiny_assets, tmp_path, *TWO_GPUS_DP2, "actor_rollout_ref.rollout.batch_requests_per_server=true",
                     "trainer.balance_batch=false")
    batch = run.actor_batches[0]
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(batch["prompt_ids"], batch["prompt_mask"])]
    prompts = rows[::4]  # the step's 8 prompts, in order, n=4 rows each
    assert len(posts) == 2 and len({url for url, _ in posts}) == 2, posts  # the two servers, not the router
    assert [ids for _, ids in posts] == [prompts[0::2], prompts[1::2]]


# ------------------------------------------------------------------------------ LoRA
@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_grpo_lora_trains_adapters_and_the_servers_serve_them(sync, ray_session, tiny_assets, tmp_path):
    """configs/tiny/grpo_lora.yaml: the actor (TP2) trains rank-8 adapters on a frozen base. Each
    push sends only the adapters (`lora.sync=adapter`: inside SGLang's /load_lora_adapter_from_tensors
    request, loaded under a name every rollout request names) or base + adapters merged (`lora.sync=merged`: the full
    weights, the base restored after). Step 2 samples from what was pushed after step 1's update:
    the servers' log-probs equal the actor's (run_recipe's check, < 1e-4 in fp32), and those
    differ from the step-1 policy's, so the servers apply the trained adapters."""
    run = run_recipe("grpo_lora", tiny_assets, tmp_path, *TWO_GPUS_TP2, "actor_rollout_ref.actor.use_kl_loss=true",
                     f"actor_rollout_ref.model.lora.sync={sync}", steps=2)
    assert run.config.actor_rollout_ref.model.lora.rank == 8
    assert run.config.actor_rollout_ref.model.lora.sync == sync
    m = run.metrics
    assert m["sync/weight_version"] == 2 and m["actor/grad_norm"] > 0, m
    if sync == "adapter":
        assert m["sync/adapter_tensors"] == 2 * 7 * 2, m  # 2 layers x 7 targets x (A, B)
        assert run.config.actor_rollout_ref.model.lora.sync_via == "tensors"
        assert not (tmp_path / "lora_sync").exists()  # the adapters travel in the request: no shared filesystem
    else:
        assert "sync/adapter_tensors" not in m and m["sync/bytes"] > 0, m
    first, second = run.actor_batches
    # the reference is the base model: at step 1 (B = 0) the LoRA actor's log-probs equal it exactly
    assert torch.equal(first["old_log_probs"], first["ref_log_probs"])
    # step 2: the adapters moved the policy away from the base, and the servers sampled from it
    mask = second["response_mask"].bool()
    assert (second["old_log_probs"] - second["ref_log_probs"])[mask].abs().max() > 1e-3
    assert (second["rollout_log_probs"] - second["old_log_probs"])[mask].abs().max() < 1e-4


def test_grpo_moe_replays_the_rollouts_routes(ray_session, tiny_assets, tmp_path):
    """configs/tiny/grpo_moe.yaml: a tiny Qwen3-MoE with routing replay. The CPU engine's routes
    come back with every sample and ride in the batch ([B, R, layers, top_k] uint8, 0 on the
    last token, which was never an input); the actor scores with them: its log-probs equal the
    rollout's at both steps (the second after a push; DP=2), the one update of a step (the whole batch
    is one mini-batch) starts from ppo_kl exactly 0, and the expert-load metrics are logged."""
    from megarl.data.tiny_model import make_tiny_model

    moe = make_tiny_model("qwen3_moe", tmp_path / "moe_model", seed=0)
    run = run_recipe("grpo_moe", tiny_assets, tmp_path, *TWO_GPUS_DP2, f"actor_rollout_ref.model.path={moe}", steps=2)
    assert run.config.trainer.n_gpus_per_node == 2  # DP=2: each rank replays the routes of its half of the batch
    m = run.metrics
    assert m["training/rollout_log_probs_diff_max"] <= TOL and m["sync/weight_version"] == 2, m
    assert m["actor/ppo_kl"] == 0.0 and m["actor/grad_norm"] > 0, m
    assert m["moe/tokens_per_expert_max"] >= m["moe/tokens_per_expert_mean"] > 0 and m["moe/load_imbalance"] >= 1
    first, second = run.actor_batches
    routes, mask = first["routed_experts"], first["response_mask"].bool()
    assert routes.shape[2:] == (2, 2) and routes.dtype == torch.uint8  # layers, top_k; 8 experts: one byte each
    last = mask.sum(1) - 1
    assert (routes[torch.arange(len(first)), last] == 0).all()  # never an input: no route, 0 as at padding
    routed = mask.clone()
    routed[torch.arange(len(first)), last] = False
    assert (routes[mask] < 8).all() and (routes[routed][..., 0] != routes[routed][..., 1]).all()  # top-2 distinct
    assert first["prompt_routed_experts"].shape[:2] == first["prompt_ids"].shape
    assert (first["old_log_probs"] - first["rollout_log_probs"])[mask].abs().max() <= TOL


# ------------------------------------------------------------------------------ context parallelism
def test_grpo_at_context_parallel_2_trains_end_to_end(ray_session, tiny_assets, tmp_path):
    """configs/tiny/grpo.yaml with the actor and the reference at CP2 on two logical GPUs (DP1;
    megarl's CPU reference CP attention, each rank holding half of every sequence): two steps. The
    servers sample step 2 from the weights CP rank 0 pushed after step 1 (their log-probs equal the
    actor's: run_recipe's check, and the rollout/trainer gap within fp32 rounding), the update (one
    mini-batch per step) starts from ppo_kl exactly 0, and the reference equals the actor at step 1."""
    cp2 = [f"actor_rollout_ref.{role}.megatron.context_parallel_size=2" for role in ("actor", "ref")]
    run = run_recipe("grpo", tiny_assets, tmp_path, "trainer.n_gpus_per_node=2", *cp2,
                     "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.use_kl_loss=true",
                     steps=2)
    assert run.config.actor_rollout_ref.actor.megatron.context_parallel_size == 2
    m = run.metrics
    assert m["training/rollout_log_probs_diff_max"] <= TOL and m["sync/weight_version"] == 2, m
    assert m["actor/ppo_kl"] == 0.0 and m["actor/grad_norm"] > 0, m
    first, second = run.actor_batches
    assert torch.equal(first["old_log_probs"], first["ref_log_probs"])  # the reference at CP2 too
    mask = second["response_mask"].bool()
    assert (second["rollout_log_probs"] - second["old_log_probs"])[mask].abs().max() < 1e-4
