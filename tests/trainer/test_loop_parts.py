"""Pure pieces of the RL loop: sampling seeds, the count of skipped (non-finite) steps, merged
round metrics, the rollout/trainer mismatch, the PPO ratio's old log-probs, best-of-n validation scores."""
import math

import pytest
import torch

from megarl.data.batch import Batch
from megarl.algos.losses import policy_loss
from megarl.config import load_config
from megarl.trainer.experience import (best_of_n, data_metrics, mean_scores, old_log_probs, old_log_probs_in_update,
                                         rewards_and_advantages, rollout_correction, rollout_mismatch,
                                         take_old_log_probs)
from megarl.trainer.rl import NonFiniteTrainingError, balanced_over_ranks, sampling_seed, skipped_steps_in_a_row


def test_sampling_seeds_depend_on_seed_step_and_prompt_only():
    assert sampling_seed(1, "s3", 7) == sampling_seed(1, "s3", 7)
    seeds = {sampling_seed(seed, prefix, i) for seed in (1, 2) for prefix in ("s0", "s1", "s1r1") for i in range(50)}
    assert len(seeds) == 2 * 3 * 50  # no collisions among these
    assert all(0 <= s < 2**31 for s in seeds)


def test_balancing_moves_whole_samples_so_each_rank_gets_as_many_tokens():
    # 4 samples of 1 + 1, 1 + 2, 1 + 3, 1 + 4 tokens (prompt + response): the halves as they come
    # hold 5 and 9 tokens; {2, 5} and {3, 4} hold 7 each, so ranks 0 and 1 get samples 0, 3 and 1, 2
    batch = Batch.from_token_lists([[5]] * 4, [[6], [6, 7], [6, 7, 8], [6, 7, 8, 9]], uid=["a", "a", "b", "b"])
    batch["scores"] = torch.tensor([0.0, 1.0, 2.0, 3.0])
    metrics = {}
    balanced = balanced_over_ranks(batch, 2, metrics)
    assert balanced["uid"] == ["a", "b", "a", "b"]
    assert balanced["scores"].tolist() == [0.0, 3.0, 1.0, 2.0]
    assert balanced["response_mask"].sum(1).tolist() == [1, 4, 2, 3]
    assert (metrics["global_seqlen/max"], metrics["global_seqlen/balanced_max"]) == (9, 7)
    odd = batch.select([0, 1, 2])  # 3 samples over 2 ranks: left as they were
    assert balanced_over_ranks(odd, 2, {}) is odd


def test_skipped_steps_are_counted_in_a_row_and_too_many_stop_the_run():
    in_a_row, logged = 0, []
    for skipped in (1.0, 0.0, 1.0, 1.0):
        metrics = {"actor/skipped_updates": skipped, "critic/skipped_updates": 0.0}
        in_a_row = skipped_steps_in_a_row(in_a_row, metrics, limit=3, step=len(logged) + 1)
        logged.append(metrics["faults/skipped_steps_in_a_row"])
    assert logged == [1.0, 0.0, 1.0, 2.0]
    with pytest.raises(NonFiniteTrainingError, match=r"step 5: .* 3 steps in a row .*max_consecutive_skipped_steps=3"):
        skipped_steps_in_a_row(in_a_row, {"critic/skipped_updates": 1.0}, limit=3, step=5)


def test_the_metrics_of_several_generation_rounds_merge_into_one_step():
    from megarl.trainer.experience import merge_round_metrics

    rounds = [{"rollout/samples": 32.0, "rollout/response_tokens": 100.0, "rollout/wall_s": 2.0,
               "rollout/latency_max_s": 1.5, "reward/num_errors": 1.0, "reward/score_mean": 0.25},
              {"rollout/samples": 32.0, "rollout/response_tokens": 300.0, "rollout/wall_s": 2.0,
               "rollout/latency_max_s": 0.5, "reward/num_errors": 0.0, "reward/score_mean": 0.75}]
    merged = merge_round_metrics(rounds)
    assert merged == {"rollout/samples": 64.0, "rollout/response_tokens": 400.0, "rollout/wall_s": 4.0,
                      "rollout/latency_max_s": 1.5, "reward/num_errors": 1.0, "reward/score_mean": 0.5,
                      "rollout/tokens_per_s": 100.0}


def test_rollout_mismatch_compares_probabilities_over_valid_tokens_only():
    actor = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.1, 0.6, 0.3]]))
    rollout = torch.log(torch.tensor([[0.5, 0.20, 0.1], [0.2, 0.6, 0.9]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])  # the third column is padding: its gaps never count
    m = rollout_mismatch(actor, rollout, mask)
    diffs = torch.tensor([0.0, 0.05, 0.1, 0.0], dtype=torch.float64)
    assert m["training/rollout_probs_diff_max"] == pytest.approx(0.1)
    assert m["training/rollout_probs_diff_mean"] == pytest.approx(diffs.mean().item())
    assert m["training/rollout_probs_diff_std"] == pytest.approx(diffs.std().item())
    assert m["training/rollout_log_probs_diff_max"] == pytest.approx(math.log(2))
    expected = torch.corrcoef(torch.tensor([[0.5, 0.25, 0.1, 0.6], [0.5, 0.2, 0.2, 0.6]]))[0, 1].item()
    assert m["training/rollout_actor_probs_pearson_corr"] == pytest.approx(expected)
    same = rollout_mismatch(actor, actor, mask)
    assert same["training/rollout_probs_diff_max"] == 0
    assert same["training/rollout_actor_probs_pearson_corr"] == pytest.approx(1.0)
    assert rollout_mismatch(actor, rollout, torch.zeros_like(mask)) == {}


def test_the_old_log_probs_are_the_trainers_or_the_rollouts_and_the_loss_follows_by_hand():
    """One stale token, A = 1: the rollout sampled it with p = 0.25, the trainer now gives 0.5 (before
    the update) and the updated policy 0.55. Decoupled PPO (the trainer's old log-probs, TIS cap 2):
    r = 0.55 / 0.5 = 1.1 inside the clip, weight min(0.5 / 0.25, 2) = 2: loss -2.2, gradient -2.2.
    The rollout's as old (use_rollout_log_probs): r = 0.55 / 0.25 = 2.2, clipped at 1.2: loss -1.2, no
    gradient (the policy already moved past the trust region around the weights that sampled it)."""
    trainer, rollout = torch.tensor([[math.log(0.5)]]), torch.tensor([[math.log(0.25)]])
    adv, mask = torch.ones(1, 1), torch.ones(1, 1)
    assert old_log_probs(trainer, rollout, False) is trainer and old_log_probs(trainer, rollout, True) is rollout
    for use_rollout, tis_cap, loss_value, grad in ((False, 2.0, -2.2, -2.2), (True, -1.0, -1.2, 0.0)):
        log_prob = torch.tensor([[math.log(0.55)]], requires_grad=True)
        loss, _ = policy_loss(old_log_probs(trainer, rollout, use_rollout), log_prob, adv, mask,
                              rollout_log_prob=rollout, tis_imp_ratio_cap=tis_cap)
        loss.backward()
        assert loss.item() == pytest.approx(loss_value) and log_prob.grad.item() == pytest.approx(grad)


@pytest.mark.parametrize("overrides, in_update", [
    ([], True),  # the default
    (["actor_rollout_ref.actor.old_log_probs_in_update=false"], False),
    (["algorithm.use_kl_in_reward=true"], False),  # the advantages read them before the update
    (["actor_rollout_ref.actor.use_rollout_log_probs=true"], False),  # the rollout's are the old ones
    (["algorithm.rollout_correction.rollout_is=token"], False),  # the correction reads them before the update
    (["algorithm.rollout_correction.rollout_rs=token_k1",
      "algorithm.rollout_correction.rollout_rs_threshold=2"], False),
    (["algorithm.rollout_correction.bypass_mode=true"], False),  # the rollout's are the old ones: no pass at all
    (["actor_rollout_ref.actor.ppo_epochs=2", "actor_rollout_ref.actor.shuffle=true",
      "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.tis_imp_ratio_cap=2"], True),
])
def test_the_update_makes_the_old_log_probs_unless_something_needs_them_before(overrides, in_update):
    assert old_log_probs_in_update(load_config(None, overrides)) is in_update


def test_taking_the_old_log_probs_sets_them_and_measures_entropy_and_mismatch_over_valid_tokens():
    batch = Batch.from_token_lists([[5, 6], [7]], [[8, 9, 10], [11]])
    batch["rollout_log_probs"] = torch.log(torch.tensor([[0.5, 0.2, 0.4], [0.1, 1.0, 1.0]]))  # log 1 = 0 at padding
    scored = {"log_probs": torch.log(torch.tensor([[0.5, 0.25, 0.4], [0.1, 1.0, 1.0]])),
              "entropy": torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])}  # 99: padding, never counted
    for use_rollout in (False, True):
        config = load_config(None, [f"actor_rollout_ref.actor.use_rollout_log_probs={str(use_rollout).lower()}"])
        metrics = take_old_log_probs(batch, scored, config)
        expected = batch["rollout_log_probs"] if use_rollout else scored["log_probs"]
        assert torch.equal(batch["old_log_probs"], expected)
        assert metrics["actor/entropy_before_update"] == pytest.approx((1 + 2 + 3 + 4) / 4)
        assert metrics["training/rollout_probs_diff_max"] == pytest.approx(0.05)
        assert not any(k.startswith("moe/") for k in metrics)
    scored["expert_tokens"] = torch.tensor([[3, 1]], dtype=torch.int32)  # one layer, two experts
    assert take_old_log_probs(batch, scored, config)["moe/tokens_per_expert_max"] == 3


def test_scoring_decodes_only_the_masked_in_response_tokens():
    """The reward sees each response's tokens where response_mask is 1: not the right padding, not
    the tokens an agent's environment inserted (mask 0 inside the response)."""
    from megarl.data.tiny_model import build_char_tokenizer
    from megarl.trainer.experience import score

    tokenizer = build_char_tokenizer()
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    batch = Batch.from_token_lists([enc("1+2="), enc("3+4=")], [enc("3xy"), enc("7!0")])
    batch["response_mask"] = torch.tensor([[1, 0, 0], [1, 0, 1]])  # row 0: padding; row 1: a tool token
    batch.meta.update(data_source=["megarl/add"] * 2, ground_truth=["3", "70"], extra_info=[None, None])
    seen = []

    def exact(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(solution_str)
        return float(solution_str == ground_truth)

    score(batch, exact, tokenizer, load_config(None, []))
    assert seen == ["3", "70"] and batch["scores"].tolist() == [1.0, 1.0]


def test_best_of_n_takes_each_prompts_best_response():
    batch = Batch.from_token_lists([[5]] * 5, [[6]] * 5)
    batch["uid"] = ["val-0", "val-0", "val-1", "val-1", "val-2"]
    batch["data_source"] = ["a", "a", "b", "b", "a"]
    batch["scores"] = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.5])
    best, sources = best_of_n(batch)
    assert best.tolist() == [1.0, 0.0, 0.5] and sources == ["a", "b", "a"]
    assert mean_scores(best, sources, "val/best@2") == {
        "val/best@2/score": pytest.approx(0.5), "val/best@2/a/score": pytest.approx(0.75), "val/best@2/b/score": 0.0}


RC = "algorithm.rollout_correction"


def test_the_rollout_correction_puts_weights_and_its_mask_in_the_batch():
    """Row 0: rho = pi_old / pi_rollout = 0.5/0.25 = 2, 0.2/0.2 = 1, 0.9/0.3 = 3; row 1: 0.1/0.2 = 0.5.
    Token TIS at cap 2.5 weighs them 2, 1, 2.5, 0.5; the mask [0.6, 2.5] drops 3 and 0.5, so
    row 1 has no token left; from then on the batch's response_mask is the kept tokens (advantages,
    critic and actor), as verl's. The model still reads every token (response_attention_mask)."""
    batch = Batch.from_token_lists([[5, 6], [7]], [[8, 9, 10], [11]])
    batch["old_log_probs"] = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.1, 1.0, 1.0]]))
    batch["rollout_log_probs"] = torch.log(torch.tensor([[0.25, 0.2, 0.3], [0.2, 1.0, 1.0]]))
    config = load_config(None, [f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=2.5", f"{RC}.rollout_rs=token_k1",
                                f"{RC}.rollout_rs_threshold=0.6_2.5"])
    dtype = batch["response_mask"].dtype
    metrics = rollout_correction(batch, config)
    assert batch["rollout_is_weights"].flatten().tolist() == pytest.approx([2, 1, 2.5, 0.5, 0, 0])
    assert batch["response_mask"].tolist() == [[1, 1, 0], [0, 0, 0]] and batch["response_mask"].dtype == dtype
    assert batch["response_attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 4)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(2 / 2)
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 4)
    untouched = Batch(dict(batch.tensors), dict(batch.meta))
    for off in ([], [f"{RC}.bypass_mode=true", f"{RC}.rollout_is=token"]):  # none on; bypass: the loss makes them
        assert rollout_correction(untouched, load_config(None, off)) == {}
        assert untouched.tensors == batch.tensors


def _rejection_batch(rho: list, scores: list) -> Batch:
    """Two responses of one prompt (lengths 3 and 2), score on each last token, the old log-probs
    log 0.5 and the rollout's making the per-token ratios `rho`."""
    batch = Batch.from_token_lists([[5], [5]], [[8, 9, 10], [11, 12]], uid=["p", "p"])
    batch["old_log_probs"] = torch.full((2, 3), math.log(0.5))
    batch["rollout_log_probs"] = batch["old_log_probs"] - torch.log(torch.tensor(rho))
    batch["token_level_scores"] = torch.tensor([[0.0, 0.0, scores[0]], [0.0, scores[1], 0.0]])
    return batch


def test_rejected_tokens_leave_the_advantages_as_verls():
    """REINFORCE++ (gamma 1) with token_k1 on [0.5, 2.0]: row 0's middle token (rho 3) is rejected
    before the advantages, as verl's trainer does. Returns over the kept tokens [1, 1 | 0, 0],
    whitened: mean 0.5, unbiased std sqrt(1/3), so +-0.866; the rejected token's advantage is 0.
    (Rejecting only after the advantages, as megarl did, whitens [1, 1, 1 | 0, 0]: 0.730 and -1.095.)"""
    batch = _rejection_batch([[1.0, 3.0, 1.0], [1.0, 1.0, 1.0]], [1.0, 0.0])
    config = load_config(None, ["algorithm.adv_estimator=reinforce_plus_plus", f"{RC}.rollout_rs=token_k1",
                                f"{RC}.rollout_rs_threshold=0.5_2.0"])
    metrics = rewards_and_advantages(batch, config)
    assert batch["response_mask"].tolist() == [[1, 0, 1], [1, 1, 0]]
    z = 0.5 / math.sqrt(1 / 3)
    assert batch["advantages"].flatten().tolist() == pytest.approx([z, 0.0, z, -z, -z, 0.0], abs=1e-5)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(1 / 5)


def test_a_rejected_token_keeps_its_reward_in_the_outcome_score_as_verls():
    """GRPO: verl sums each row's token rewards over every position, so rejecting the token that
    carries the score (row 0's last, rho 3) leaves the group's scores [1, 0]: advantages +-1/sqrt(2)
    on the kept tokens (summing over the kept tokens only would make the group uniform: all 0)."""
    batch = _rejection_batch([[1.0, 1.0, 3.0], [1.0, 1.0, 1.0]], [1.0, 0.0])
    config = load_config(None, ["algorithm.adv_estimator=grpo", f"{RC}.rollout_rs=token_k1",
                                f"{RC}.rollout_rs_threshold=0.5_2.0"])
    rewards_and_advantages(batch, config)
    assert batch["response_mask"].tolist() == [[1, 1, 0], [1, 1, 0]]
    a = 1 / math.sqrt(2)
    assert batch["advantages"].flatten().tolist() == pytest.approx([a, a, 0.0, -a, -a, 0.0], abs=1e-5)


def test_the_data_metrics_measure_lengths_on_the_real_tokens_not_the_kept_ones():
    batch = _rejection_batch([[1.0, 3.0, 1.0], [1.0, 1.0, 1.0]], [1.0, 0.0])
    batch.meta.update(finish_reason=["stop", "length"])
    batch["scores"] = torch.tensor([1.0, 0.0])
    rewards_and_advantages(batch, load_config(None, ["algorithm.adv_estimator=grpo", f"{RC}.rollout_rs=token_k1",
                                                     f"{RC}.rollout_rs_threshold=0.5_2.0"]))
    m = data_metrics(batch)
    assert m["response_length/mean"] == 2.5 and m["response_length/max"] == 3  # 3 and 2, one token rejected
    assert m["advantages/min"] == pytest.approx(-1 / math.sqrt(2), abs=1e-5)  # over the kept tokens


def test_the_off_policy_diagnostics_are_logged_with_every_correction_off():
    """verl logs them whenever the rollout's log-probs exist: kl = mean(rollout - trainer) over valid
    tokens; chi2_token = mean(rho^2) - 1; the per-row perplexities exp(-mean log p)."""
    batch = Batch.from_token_lists([[5, 6], [7]], [[8, 9, 10], [11]])
    batch["rollout_log_probs"] = torch.log(torch.tensor([[0.5, 0.2, 0.4], [0.1, 1.0, 1.0]]))
    scored = {"log_probs": torch.log(torch.tensor([[0.5, 0.25, 0.4], [0.2, 1.0, 1.0]])),
              "entropy": torch.ones(2, 3)}
    m = take_old_log_probs(batch, scored, load_config(None, []))
    rho = [1.0, 1.25, 1.0, 2.0]
    assert m["rollout_corr/kl"] == pytest.approx(-sum(math.log(r) for r in rho) / 4)
    assert m["rollout_corr/chi2_token"] == pytest.approx(sum(r * r for r in rho) / 4 - 1)
    row_ppl = [math.exp(-(math.log(0.5) + math.log(0.25) + math.log(0.4)) / 3), 1 / 0.2]
    assert m["rollout_corr/training_ppl"] == pytest.approx(sum(row_ppl) / 2)
