"""The engine's pure parts, in-process (no megatron world): micro-batch planning and layout,
storage offload, the LR schedule, the padded vocabulary, config-level refusals, the gradients' finite check."""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from megarl.config.schema import MegatronConfig, OptimConfig
from megarl.data.batch import Batch
from megarl.engines.megatron import offload
from megarl.engines.megatron.model import padded_vocab, sequence_parallel_problem
from megarl.engines.megatron.optim import build_scheduler
from megarl.engines.megatron.parallel import role_layout
from megarl.engines.megatron.replay import router_rows
from megarl.engines.megatron.sequences import fixed_shape, length_multiple, make_micro_batch, micro_batch_groups
from megarl.engines.megatron.training import has_non_finite, rows_to_train


def test_micro_batch_groups_by_size_by_tokens_and_multiple_of_pp():
    assert micro_batch_groups([5] * 6, max_samples=2) == [[0, 1], [2, 3], [4, 5]]
    assert micro_batch_groups([5] * 6, max_samples=None) == [list(range(6))]
    assert micro_batch_groups([5] * 6, max_samples=2, multiple_of=2) == [[0, 1], [2, 3], [4], [5]]
    groups = micro_batch_groups([9, 2, 7, 3, 8, 1], max_tokens=10)
    assert sorted(i for g in groups for i in g) == list(range(6))
    assert all(sum([9, 2, 7, 3, 8, 1][i] for i in g) <= 10 for g in groups)
    assert len(micro_batch_groups([9, 2, 7, 3, 8, 1], max_tokens=10, multiple_of=4)) % 4 == 0
    with pytest.raises(ValueError, match="cannot fill 2 micro-batches"):
        micro_batch_groups([5], max_samples=1, multiple_of=2)


def test_padded_micro_batch_puts_each_target_after_its_context():
    batch = Batch.from_token_lists([[11, 12, 13], [21]], [[14, 15], [22, 23, 24]])
    mb = make_micro_batch(batch, [0, 1], "padded", vocab_size=47, device=torch.device("cpu"))
    # prompt then response, padding removed and right-padded; positions from 0
    assert mb.input_ids.tolist() == [[11, 12, 13, 14, 15], [21, 22, 23, 24, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4]] * 2
    assert mb.targets.tolist() == [14, 15, 22, 23, 24]
    # hidden states are [S, b, H] flattened: row s * b + i predicts token s + 1 of sample i
    s, i = mb.token_index // 2, mb.token_index % 2
    assert mb.input_ids[i, s + 1].tolist() == mb.targets.tolist()
    grid = mb.to_grid(torch.arange(1.0, 6.0))
    assert grid.tolist() == [[1.0, 2.0, 0.0], [3.0, 4.0, 5.0]]
    # a fixed shape (interleaved pipeline): extra padding sequences and columns, same targets
    assert fixed_shape(batch, [[0], [1]], "padded") == (1, 5) and fixed_shape(batch, [[0, 1]], "packed") == (1, 9)
    wide = make_micro_batch(batch, [0, 1], "padded", vocab_size=47, device=torch.device("cpu"), shape=(3, 7))
    assert wide.input_ids.shape == (3, 7) and wide.input_ids[:2, :5].tolist() == mb.input_ids.tolist()
    s, i = wide.token_index // 3, wide.token_index % 3
    assert wide.input_ids[i, s + 1].tolist() == wide.targets.tolist() == mb.targets.tolist()


def test_sequence_parallel_micro_batches_are_padded_to_a_multiple_of_tp():
    """megatron splits the sequence evenly over the TP ranks: 5 tokens become 6 at TP2 (8 at TP4),
    the extra column is padding after every real token, and the targets and their rows stay."""
    batch = Batch.from_token_lists([[11, 12, 13], [21]], [[14, 15], [22, 23, 24]])
    assert [length_multiple(tp, sp) for tp, sp in ((2, True), (4, True), (2, False), (1, False))] == [2, 4, 1, 1]
    plain = make_micro_batch(batch, [0, 1], "padded", vocab_size=47, device=torch.device("cpu"))
    for tp, width in ((2, 6), (4, 8)):
        mb = make_micro_batch(batch, [0, 1], "padded", vocab_size=47, device=torch.device("cpu"), multiple=tp)
        assert mb.input_ids.shape == (2, width) and mb.input_ids[:, :5].tolist() == plain.input_ids.tolist()
        assert bool((mb.input_ids[:, 5:] == 0).all())
        assert mb.token_index.tolist() == plain.token_index.tolist() and mb.targets.tolist() == plain.targets.tolist()
    assert fixed_shape(batch, [[0], [1]], "padded", 4) == (1, 8) and fixed_shape(batch, [[0, 1]], "packed", 2) == (1, 10)


def test_router_rows_are_each_tp_ranks_part_of_the_sequence_with_sequence_parallelism():
    # [S=4, b=3] flattened to 12 rows s * b + j; TP2 splits S: rank 0 has positions 0-1 (rows 0-5)
    assert router_rows(12, 2, 0, True).tolist() == list(range(6))
    assert router_rows(12, 2, 1, True).tolist() == list(range(6, 12))
    assert router_rows(12, 2, 1, False).tolist() == list(range(12))  # every TP rank routes every token
    with pytest.raises(ValueError, match="13 token rows cannot be split evenly over 2"):
        router_rows(13, 2, 0, True)


@pytest.mark.parametrize("sp, on_cuda, te, refused", [
    (True, True, False, True),  # megatron's local spec on a GPU: its torch norm refuses sequence parallelism
    (True, True, True, False),  # transformer-engine layers take it
    (True, False, False, False),  # CPU: the sequence_parallel_norm shim
    (False, True, False, False),
])
def test_sequence_parallelism_on_a_gpu_needs_transformer_engine_layers(sp, on_cuda, te, refused):
    problem = sequence_parallel_problem(sp, on_cuda=on_cuda, transformer_engine_layers=te)
    assert (problem is not None) == refused
    if refused:
        assert problem.startswith("sequence_parallel=true on a GPU needs transformer-engine layers")


def test_micro_batch_refuses_responses_without_context_and_unknown_tokens():
    with pytest.raises(ValueError, match="sample 1 has no prompt token"):
        make_micro_batch(Batch.from_token_lists([[5], []], [[6], [7]]), [0, 1], "padded", 47, torch.device("cpu"))
    with pytest.raises(ValueError, match="token id 99 is outside the model's vocabulary of 47"):
        make_micro_batch(Batch.from_token_lists([[5]], [[99]]), [0], "padded", 47, torch.device("cpu"))
    with pytest.raises(KeyError, match="no 'advantages'"):
        make_micro_batch(Batch.from_token_lists([[5]], [[6]]), [0], "padded", 47, torch.device("cpu"), ["advantages"])


def test_offload_frees_storages_and_onload_restores_every_view():
    flat = torch.arange(12.0)
    views = flat[:6].view(2, 3), flat[6:]
    grads = torch.full((4,), 7.0)
    cpu = torch.device("cpu")
    kept, dropped = offload.unique_storages([*views, flat], cpu), offload.unique_storages([grads], cpu)
    assert len(kept) == 1  # one storage behind the three tensors
    record, stats = offload.offload(kept, dropped, cpu)
    assert stats["bytes"] == 48 and stats["freed_bytes"] == 64
    assert flat.untyped_storage().nbytes() == 0 and grads.untyped_storage().nbytes() == 0
    back = offload.onload(record, cpu)
    assert back["bytes"] == 48
    assert torch.equal(torch.cat([views[0].flatten(), views[1]]), torch.arange(12.0))
    assert grads.tolist() == [0.0] * 4  # gradients come back zeroed


class _Buffer:
    def __init__(self, param_data, grad_data):
        self.param_data, self.grad_data = param_data, grad_data


class _DDPChunk:
    def __init__(self, *buffers):
        self.buffers, self.expert_parallel_buffers = list(buffers), []


class _MegatronOptimizer:  # megatron's optimizer wraps the torch one as `.optimizer`
    def __init__(self, torch_optimizer):
        self.optimizer = torch_optimizer


def _offloader(shared_grad: bool = False):
    """An fp32 engine as megatron's distributed optimizer lays it out: parameters are views of one
    DDP parameter buffer, the optimizer steps views of it too (fp32: no master copy), Adam's
    moments are its own. With `shared_grad`, the gradient buffer is the parameter buffer (MXFP8)."""
    param_data = torch.arange(1.0, 13.0)
    grad_data = param_data if shared_grad else torch.ones(16)
    model = torch.nn.Module()
    model.a = torch.nn.Parameter(param_data[:8].view(2, 4))
    model.b = torch.nn.Parameter(param_data[8:])
    model.a.data, model.b.data = param_data[:8].view(2, 4), param_data[8:]  # views of the buffer, as DDP makes them
    shard = torch.nn.Parameter(param_data[4:])
    shard.data = param_data[4:]
    adam = torch.optim.Adam([shard], lr=0.1)
    shard.grad = torch.ones(8)
    adam.step()
    ddp = _DDPChunk(_Buffer(param_data, grad_data))
    return offload.Offloader("actor", [model], [ddp], _MegatronOptimizer(adam), torch.device("cpu")), model, adam


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def test_offload_moves_only_the_parts_asked_and_each_shared_storage_once():
    offloader, model, adam = _offloader()
    (state,) = adam.state.values()
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    state_bytes = sum(_nbytes(v) for v in state.values())  # exp_avg, exp_avg_sq and the step count
    assert state_bytes == 2 * 32 + 4
    before = [t.clone() for t in (model.a, model.b, exp_avg, exp_avg_sq)]
    # gradients and optimizer only: the buffer the optimizer steps is the parameters', and stays
    stats = offloader.offload(params=False, grads=True, optimizer=True)
    assert (stats["params_bytes"], stats["grads_bytes"], stats["optimizer_bytes"]) == (0, 64, state_bytes)
    assert stats["bytes"] == state_bytes and stats["freed_bytes"] == 64 + state_bytes
    assert _nbytes(model.a) == 48 and _nbytes(exp_avg) == 0 and _nbytes(offloader.ddp_chunks[0].buffers[0].grad_data) == 0
    with pytest.raises(RuntimeError, match="actor: the engine's grads, optimizer are offloaded"):
        offloader.check_onloaded()
    offloader.check_onloaded(("params",))  # a push may still read the parameters
    # then the rest (colocated: after the push): the parts already off do not move again
    stats = offloader.offload()
    assert (stats["params_bytes"], stats["grads_bytes"], stats["optimizer_bytes"], stats["bytes"]) == (48, 0, 0, 48)
    with pytest.raises(RuntimeError, match="actor: the engine's params are offloaded"):
        offloader.check_onloaded(("params",))
    assert offloader.offload()["bytes"] == 0  # all off: nothing more moves
    assert offloader.onload()["bytes"] == state_bytes + 48
    assert all(torch.equal(a, b) for a, b in zip(before, (model.a, model.b, exp_avg, exp_avg_sq)))
    assert offloader.ddp_chunks[0].buffers[0].grad_data.tolist() == [0.0] * 16
    # parameters only: the one buffer behind both parameters and the optimizer's view moves once
    stats = offloader.offload(params=True, grads=False, optimizer=False)
    assert (stats["params_bytes"], stats["grads_bytes"], stats["optimizer_bytes"], stats["bytes"]) == (48, 0, 0, 48)
    assert _nbytes(model.b) == 0 and _nbytes(exp_avg) == 32
    offloader.onload()
    assert all(torch.equal(a, b) for a, b in zip(before, (model.a, model.b, exp_avg, exp_avg_sq)))
    assert offloader.offload(params=False, grads=False, optimizer=False)["freed_bytes"] == 0
    offloader.check_onloaded()  # nothing asked, nothing offloaded


def test_a_gradient_buffer_that_holds_parameters_is_copied_with_them_never_dropped():
    offloader, model, _ = _offloader(shared_grad=True)
    before = [model.a.clone(), model.b.clone()]
    assert offloader.offload(params=False, grads=True, optimizer=False)["grads_bytes"] == 0
    assert _nbytes(model.a) == 48
    offloader.onload()
    stats = offloader.offload(params=True, grads=True, optimizer=False)
    assert (stats["params_bytes"], stats["grads_bytes"], stats["bytes"]) == (48, 0, 48)
    offloader.onload()
    assert torch.equal(model.a, before[0]) and torch.equal(model.b, before[1])


def _scheduler(**optim):
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([{"params": [param], "wd_mult": 1.0}], lr=0.0)
    return optimizer, build_scheduler(optimizer, OptimConfig(lr=1e-3, **optim), "actor_rollout_ref.actor")


def test_lr_schedule_warms_up_from_the_first_update_then_decays():
    optimizer, scheduler = _scheduler(lr_warmup_steps=4, warmup_style="cosine", total_training_steps=10,
                                      min_lr_ratio=0.1)
    lrs = []
    for _ in range(10):
        scheduler.step(1)  # what each update call does before its optimizer steps
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs[:4] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert lrs[-1] == pytest.approx(1e-4) and all(b <= a for a, b in zip(lrs[3:], lrs[4:]))
    assert optimizer.param_groups[0]["weight_decay"] == 0.01


def test_lr_schedule_over_lr_decay_steps_may_outlast_the_run():
    """verl's reading (verl/utils/megatron/optimizer.py get_megatron_optimizer_param_scheduler): the decay runs
    over lr_decay_steps, a warm-up ratio is a fraction of it; megatron's linear warm-up is lr x step / warm-up."""
    optimizer, scheduler = _scheduler(lr_warmup_steps=10, lr_decay_steps=100, total_training_steps=2)
    lrs = []
    for _ in range(2):
        scheduler.step(1)
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx([1e-4, 2e-4])
    optimizer, scheduler = _scheduler(lr_warmup_steps_ratio=0.1, lr_decay_steps=40, total_training_steps=2)
    scheduler.step(1)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 / 4)  # 0.1 x 40 = 4 warm-up steps
    with pytest.raises(ValueError, match=r"10 warm-up steps must be fewer than the 10 decay steps"):
        _scheduler(lr_warmup_steps=10, lr_decay_steps=10, total_training_steps=200)


def test_lr_schedule_decays_to_verls_absolute_min_lr():
    """verl's Megatron optim.min_lr is megatron's OptimizerParamScheduler min_lr: a cosine decay over 4 updates
    from 1e-3 ends at it, through min + (max - min) (1 + cos(pi k / 4)) / 2 (megatron's formula, by hand)."""
    optimizer, scheduler = _scheduler(min_lr=2e-4, warmup_style="cosine", lr_warmup_steps=0, total_training_steps=4)
    lrs = []
    for _ in range(4):
        scheduler.step(1)
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx([2e-4 + 8e-4 * (1 + math.cos(math.pi * k / 4)) / 2 for k in (1, 2, 3, 4)])
    assert lrs[-1] == pytest.approx(2e-4)


def test_lr_schedule_errors_name_the_config_key():
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.actor\.optim\.lr_warmup_steps_ratio=0\.1 needs"):
        _scheduler(lr_warmup_steps_ratio=0.1)
    with pytest.raises(ValueError, match=r"warmup_style=cosine decays .*total_training_steps, which is -1"):
        _scheduler(warmup_style="cosine")


def test_padded_vocabulary_does_not_depend_on_tp():
    assert [padded_vocab(47, tp) for tp in (1, 2, 4, 8)] == [128] * 4
    assert padded_vocab(151655, 8) == 151680
    assert padded_vocab(100, 3) == 384  # lcm(128, 3)


def test_parallel_sizes_are_read_and_bad_ones_refused_by_name():
    with pytest.raises(ValueError, match=r"critic\.megatron\.context_parallel_size=0: must be a positive integer"):
        role_layout(MegatronConfig(context_parallel_size=0), "critic.megatron")
    with pytest.raises(ValueError, match=r"x\.virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size"):
        role_layout(MegatronConfig(virtual_pipeline_model_parallel_size=2), "x")
    assert role_layout(MegatronConfig(context_parallel_size=2), "x").cp == 2
    assert role_layout(MegatronConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                      virtual_pipeline_model_parallel_size=2), "x").vpp == 2


def test_sequence_parallel_runs_only_with_tensor_parallelism():
    assert role_layout(MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True), "x").sp
    assert not role_layout(MegatronConfig(tensor_model_parallel_size=2), "x").sp
    assert not role_layout(MegatronConfig(sequence_parallel=True), "x").sp  # TP 1: off, as verl has it


def test_unmasked_vocabulary_padding_would_fail_the_comparison(tiny_models):
    """Negative control: the padded output rows are zero; had the engine not masked those logit
    columns, its log-probs would be off by far more than the tolerance."""
    model = AutoModelForCausalLM.from_pretrained(tiny_models["qwen2"], dtype=torch.float32).eval()
    ids = torch.arange(4, 20)[None]
    with torch.no_grad():
        logits = model(ids).logits[0] / 0.7
    rows = padded_vocab(logits.shape[-1], tp=2)
    padded = torch.cat([logits, torch.zeros(logits.shape[0], rows - logits.shape[-1])], -1)
    assert (padded.log_softmax(-1)[:, : logits.shape[-1]] - logits.log_softmax(-1)).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_finite_check_finds_every_nan_and_infinity_wherever_it_is(dtype):
    """`has_non_finite` (the update's skip check) against torch.isfinite on the same gradients:
    one NaN, +inf or -inf at the start, inside, or at the end of a buffer (the vectorised
    reduction's tail), none; finite values at the dtype's limits are finite."""
    grads = torch.randn(1031, generator=torch.Generator().manual_seed(0)).to(dtype)
    cases = [grads, grads.clone().fill_(torch.finfo(dtype).max), torch.tensor([], dtype=dtype)]
    for value in (float("nan"), float("inf"), float("-inf")):
        for position in (0, 17, 515, 1030):
            bad = grads.clone()
            bad[position] = value
            cases.append(bad)
    for values in cases:
        assert bool(has_non_finite(values)) == bool((~torch.isfinite(values)).any())
    assert sum(bool(has_non_finite(values)) for values in cases) == 12


@pytest.mark.parametrize("skippable, min_rows, expected", [
    ([False, True, True, False, True, False], 1, [5, 0, 3]),  # the mini-batch's rows that learn, in its order
    ([True] * 6, 1, [5]),  # none learns: its first row runs (loss 0), so the rank meets the others
    ([True, True, True, True, True, False], 2, [5, 0]),  # the interleaved schedule's PP = 2 micro-batches
    ([False] * 6, 2, [5, 0, 1, 3, 4, 2]),  # nothing to leave out: every row, none added
])
def test_rows_to_train_by_hand(skippable, min_rows, expected):
    rows = torch.tensor([5, 0, 1, 3, 4, 2])  # a shuffled mini-batch's rows; `skippable` is over the batch's rows
    assert rows_to_train(rows, torch.tensor(skippable), min_rows).tolist() == expected
