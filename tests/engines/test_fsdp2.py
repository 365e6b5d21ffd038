"""`megatron.use_torch_fsdp2` on real megatron-core (CPU, gloo, 2 ranks), against megatron's own DDP and
optimizer (the oracle) on the same PPO updates, at DP2, TP2 (DP1) and CP2 (DP1, full recompute) in float32,
DP2 in bfloat16, two pipeline stages (PP2, DP1: untied under 1F1B, a tied embedding under the
interleaved schedule), a tiny MoE at EP2 (with routing replay) and EP1, and a tiny GLM-4-MoE whose routers'
expert bias megatron updates, at EP2 (fsdp2_world.py); checkpoints
saved after update UPDATES - 1 and resumed (bit for bit at the same layout, resharded to DP1, refused at
another TP, PP or EP size) and exported to HF; an offload and onload between updates (the shards'
hand-counted bytes moved, the next update an un-offloaded engine's bit for bit).

Tolerance: FSDP2 reduce-scatters each micro-batch's gradient (megatron's DDP sums the micro-batches
first, then all-reduces) and sums the gradient norm over shards, so at DP2 / CP2 the float32 results
differ by rounding: losses and norms within rel 1e-5, weights within 1e-6 absolute. At TP2 (DP1)
without clipping the weights are the same bit for bit. In bfloat16 the gradients are rounded at other
places (megatron adds each micro-batch's bf16 gradient into its fp32 buffer; FSDP2 casts it to fp32
for the reduce-scatter): within rel 2e-2, weights within one bf16 rounding."""
import pytest
import torch
from engine_world import training_batch
from fsdp2_world import (LAYOUTS, MOE_LAYOUTS, MOE_REPLAYED, PP_LAYOUTS, PP_RESUMED, RESUMED, UPDATES, fsdp2_config,
                         fsdp2_dp1_resume, fsdp2_world, pp_config)

from megarl.data.tiny_model import make_tiny_model
from megarl.engines.megatron.fsdp2 import mesh_device_type
from megarl.testing import run_gloo_workers

pytestmark = pytest.mark.slow  # one 2-rank world, 29 engines, and a 1-rank one: ~100 s on 2 cores
FP32 = [name for name, layout in LAYOUTS.items() if layout[3] == "float32"]
MOE = list(MOE_LAYOUTS)
LOSSES = ("actor/pg_loss", "actor/actor_loss", "actor/entropy", "actor/kl_loss", "actor/ppo_kl")


def tolerance(layout: str) -> dict:
    return {"rel": 1e-5, "abs": 1e-7} if LAYOUTS[layout][3] == "float32" else {"rel": 2e-2, "abs": 1e-4}


def hf_first_update(model_dir, batch, old_log_probs, cfg) -> tuple[float, float]:
    """The oracle of the first update, in one process: (loss, L2 norm of its gradient over every
    parameter) of the whole mini-batch's actor loss from HF transformers' fp32 model and torch's autograd."""
    from transformers import AutoModelForCausalLM

    from megarl.algos.from_config import actor_loss_kwargs
    from megarl.algos.losses import actor_loss

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    shape = batch["response_mask"].shape
    log_probs, entropy = [], []
    for i in range(len(batch)):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()]
        response = batch["response_ids"][i][batch["response_mask"][i].bool()]
        logp = model(torch.cat([prompt, response])[None]).logits[0].float().log_softmax(-1)
        at = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(response))
        pad = shape[1] - len(response)
        log_probs.append(torch.nn.functional.pad(logp[at, response], (0, pad)))
        entropy.append(torch.nn.functional.pad(-(logp[at].exp() * logp[at]).sum(-1), (0, pad)))
    loss, _ = actor_loss(torch.stack(log_probs), old_log_probs, batch["advantages"], batch["response_mask"],
                         entropy=torch.stack(entropy), ref_log_prob=batch["ref_log_probs"],
                         **actor_loss_kwargs(cfg.actor_rollout_ref.actor))
    loss.backward()
    norm = torch.sqrt(sum(p.grad.double().square().sum() for p in model.parameters() if p.grad is not None))
    return loss.item(), norm.item()


@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp2_checkpoints")


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """A tiny Qwen3-MoE (2 layers, 8 experts, top 2) and a tiny GLM-4-MoE (its routers with an expert bias)."""
    root = tmp_path_factory.mktemp("fsdp2_moe")
    return {"qwen3_moe": make_tiny_model("qwen3_moe", root / "qwen3_moe", layers=2, hidden=64, heads=4, kv_heads=2,
                                         intermediate=32, seed=3),
            "glm4_moe": make_tiny_model("glm4_moe", root / "glm4_moe", layers=2, hidden=64, heads=4, kv_heads=2,
                                        intermediate=32, seed=3)}


@pytest.fixture(scope="module")
def run(tiny_models, ckpt_root, moe_models):
    """{(layout, fsdp2) or ("resume", layout): [rank 0's result, rank 1's]} (layouts: LAYOUTS, PP_LAYOUTS and
    MOE_LAYOUTS)."""
    models = {name: str(tiny_models[name]) for name, _ in PP_LAYOUTS.values()}
    ranks = run_gloo_workers(fsdp2_world, 2, args=(str(tiny_models["qwen2"]), list(LAYOUTS), str(ckpt_root), models,
                                                   str(moe_models["qwen3_moe"]), str(moe_models["glm4_moe"])),
                             timeout_s=500)
    return {key: [rank[key] for rank in ranks] for key in ranks[0]}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_losses_and_grad_norms_equal_ddps(run, layout):
    ddp, fsdp = run[(layout, False)][0]["metrics"], run[(layout, True)][0]["metrics"]
    assert len(fsdp) == UPDATES and [m["actor/skipped_updates"] for m in fsdp] == [0.0] * UPDATES
    assert [m["actor/lr"] for m in fsdp] == [m["actor/lr"] for m in ddp]  # megatron's warm-up + cosine schedule
    for a, b in zip(ddp, fsdp):
        # in bf16 ppo_kl (~1e-3) is the mean difference of two bf16-rounded log-probs: rounding, no oracle
        for key in [k for k in LOSSES + ("actor/grad_norm",) if layout in FP32 or k != "actor/ppo_kl"]:
            assert b[key] == pytest.approx(a[key], **tolerance(layout)), (key, a[key], b[key])
    losses = [m["actor/pg_loss"] for m in fsdp]
    assert losses[-1] < losses[0]  # it learns
    assert run[(layout, True)][0]["metrics"] == run[(layout, True)][1]["metrics"]  # the same on both ranks


@pytest.mark.parametrize("layout", FP32)
def test_first_update_is_hfs_loss_and_gradient_norm(run, layout, tiny_models):
    """The first update's loss and gradient norm (before clipping) are those of HF's model on the
    whole mini-batch: the FSDP2 reduce-scatter's average and megarl's loss scaling give the global
    mini-batch's gradient, counted once over the DP x CP shards and TP ranks."""
    tp, cp, clip, dtype, _ = LAYOUTS[layout]
    cfg = fsdp2_config(str(tiny_models["qwen2"]), 2, tp, cp, clip, dtype, False, True)
    parts = sorted({r["dp_rank"]: r["old_log_probs"] for r in run[(layout, True)]}.items())
    loss, norm = hf_first_update(tiny_models["qwen2"], training_batch(), torch.cat([p for _, p in parts]), cfg)
    first = run[(layout, True)][0]["metrics"][0]
    assert first["actor/actor_loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    assert first["actor/grad_norm"] == pytest.approx(norm, rel=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gathered_weights_and_log_probs_equal_ddps(run, layout):
    fp32 = LAYOUTS[layout][3] == "float32"
    for ddp, fsdp in zip(run[(layout, False)], run[(layout, True)]):
        assert ddp["params"].keys() == fsdp["params"].keys()
        for name, weight in ddp["params"].items():
            assert fsdp["params"][name].dtype == weight.dtype == (torch.float32 if fp32 else torch.bfloat16)
            torch.testing.assert_close(fsdp["params"][name], weight, msg=name,
                                       **(dict(rtol=1e-5, atol=1e-6) if fp32 else dict(rtol=1.6e-2, atol=1e-3)))
        if ddp["scored_after"] is not None:
            torch.testing.assert_close(fsdp["scored_after"]["log_probs"], ddp["scored_after"]["log_probs"],
                                       **(dict(rtol=1e-5, atol=1e-5) if fp32 else dict(rtol=2e-2, atol=2e-2)))


def test_without_reduction_or_clipping_the_weights_and_push_are_ddps_bit_for_bit(run):
    assert LAYOUTS["tp2"] == (2, 1, 0.0, "float32", False)
    for ddp, fsdp in zip(run[("tp2", False)], run[("tp2", True)]):
        assert all(torch.equal(fsdp["params"][n], w) for n, w in ddp["params"].items())
        assert fsdp["pushed"].keys() == ddp["pushed"].keys()
        assert all(torch.equal(fsdp["pushed"][n], t) for n, t in ddp["pushed"].items())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_push_before_any_forward_sends_the_initial_weights_bit_for_bit(run, layout):
    ddp, fsdp = run[(layout, False)][0]["pushed_initial"], run[(layout, True)][0]["pushed_initial"]
    assert len(ddp) > 10 and fsdp.keys() == ddp.keys()
    assert all(fsdp[n].dtype == t.dtype and torch.equal(fsdp[n], t) for n, t in ddp.items())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_push_sends_ddps_tensors(run, layout):
    """The push's HF tensors (names, shapes, dtypes, values) after the updates: rank 0 emits them all."""
    ddp, fsdp = run[(layout, False)][0]["pushed"], run[(layout, True)][0]["pushed"]
    assert len(ddp) > 10 and fsdp.keys() == ddp.keys()
    assert run[(layout, True)][1]["pushed"] == {} == run[(layout, False)][1]["pushed"]
    fp32 = LAYOUTS[layout][3] == "float32"
    for name, tensor in ddp.items():
        assert fsdp[name].dtype == tensor.dtype and fsdp[name].shape == tensor.shape
        torch.testing.assert_close(fsdp[name], tensor, msg=name,
                                   **(dict(rtol=1e-5, atol=1e-6) if fp32 else dict(rtol=1.6e-2, atol=1e-3)))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_rank_holds_its_shard_only(run, layout):
    """Every parameter is a DTensor `Shard(0)` over the DP x CP mesh (size 2 at DP2 and CP2, 1 at TP2),
    in float32 whatever the model's dtype; the group's local tensors put together are the weights the
    engine gathers for the push, and this rank's is torch's own split of them (`torch.chunk` along
    dim 0, DTensor's Shard rule); the Adam moments have the local shape."""
    tp = LAYOUTS[layout][0]
    mesh = 2 // tp
    for rank, result in enumerate(run[(layout, True)]):
        shards = result["shards"]
        assert shards and all(s["shard0"] and s["mesh_size"] == mesh for s in shards.values())
        assert {s["rank"] for s in shards.values()} == {rank if mesh == 2 else 0}
        for name, s in shards.items():
            whole = torch.cat(s["parts"])
            assert whole.dtype == torch.float32
            assert torch.equal(whole.to(result["params"][name].dtype), result["params"][name]), name
            part = torch.chunk(whole, mesh, dim=0)
            expected = part[s["rank"]] if s["rank"] < len(part) else whole[:0]
            assert torch.equal(s["local"], expected), name
            assert result["adam_state_shapes"][name] == (tuple(expected.shape), (tuple(expected.shape),) * 2)
        if mesh == 2:
            assert sum(s["local"].numel() for s in shards.values()) < sum(
                result["params"][n].numel() for n in shards)


def test_a_critic_trains_as_with_ddp(run):
    """The critic at DP2: its value head is read inside the forward step, as the actor's output layer."""
    ddp, fsdp = run[("critic", False)][0], run[("critic", True)][0]
    assert len(fsdp) == UPDATES and fsdp == run[("critic", True)][1]  # the same metrics on both ranks
    for a, b in zip(ddp, fsdp):
        for key in ("critic/vf_loss", "critic/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (key, a[key], b[key])
        assert b["critic/skipped_updates"] == 0.0
    assert fsdp[-1]["critic/vf_loss"] < fsdp[0]["critic/vf_loss"]


def test_verls_megatron_fsdp_key_trains_the_fsdp2_path(run):
    """`use_megatron_fsdp=true` (with megatron's distributed-optimizer flag on, as verl sets it) builds the FSDP2
    engine, not megatron's DDP: its updates and push are `use_torch_fsdp2`'s bit for bit."""
    for verl, torch_fsdp2, ddp in zip(run["verl_megatron_fsdp"], run[("dp2", True)], run[("dp2", False)]):
        assert verl["fsdp2"] and not verl["use_distributed_optimizer"] and not ddp["fsdp2"]
        assert verl["metrics"] == torch_fsdp2["metrics"]
        assert verl["pushed"].keys() == torch_fsdp2["pushed"].keys()
        assert all(torch.equal(verl["pushed"][k], torch_fsdp2["pushed"][k]) for k in verl["pushed"])


def test_megatrons_ddp_refuses_an_fsdp2_checkpoints_optimizer_state_and_loads_its_weights(run):
    """An FSDP2 checkpoint's model part is the DDP path's format (its weights load); its optimizer state is
    FSDP2's, refused by name rather than failing inside megatron's load on missing optimizer keys."""
    for ddp, fsdp2 in zip(run["ddp_from_fsdp2"], run[("dp2", True)]):
        assert ddp["refused"] is not None and "is a megatron.use_torch_fsdp2 checkpoint" in ddp["refused"]
        saved = fsdp2["at_save"]["pushed"]
        assert ddp["pushed"].keys() == saved.keys()
        assert all(torch.equal(ddp["pushed"][k], saved[k]) for k in saved)


def test_weight_decay_groups_are_megatrons(run):
    """No decay on biases and 1-D parameters: the FSDP2 AdamW's groups against megatron's optimizer's (for the
    MoE its dense and expert optimizers chained)."""
    for layout in [*LAYOUTS, *MOE]:
        for ddp, fsdp in zip(run[(layout, False)], run[(layout, True)]):
            assert fsdp["wd_mult"] == ddp["wd_mult"]
            assert set(fsdp["wd_mult"].values()) == {0.0, 1.0}


def test_a_non_finite_loss_on_one_rank_skips_the_update_everywhere(run):
    for layout in [*LAYOUTS, *MOE]:
        for result in run[(layout, True)]:
            assert result["poisoned"] == {"skipped": 1.0, "unchanged": True}


def test_background_saves_are_refused_naming_the_key(run):
    for result in run[("dp2", True)]:
        background = result["refused"]
        assert background and background.startswith("actor_rollout_ref.actor.checkpoint.async_save=true with "
                                                     "actor_rollout_ref.actor.megatron.use_torch_fsdp2=true")


def _shard_bytes(shapes: list, rank: int, mesh: int) -> dict:
    """Hand count of one rank's bytes at DP `mesh`, from the parameters' global shapes (float32 all): FSDP2
    pads every rank's shard of a parameter, and the gradient's, to the first rank's `ceil(rows / mesh)` rows
    (torch.chunk's first chunk); the AdamW moments are `zeros_like` of the unpadded shard (this rank's
    torch.chunk, DTensor's Shard(0) rule), and each parameter's `step` a float32 scalar (on a CPU engine, host
    memory is the device: it moves too)."""
    def rows(shape, index):
        return len(range(index * -(-shape[0] // mesh), min(shape[0], (index + 1) * -(-shape[0] // mesh))))

    def numel(shape, index):
        return rows(shape, index) * int(torch.Size(shape[1:]).numel())

    padded = sum(numel(shape, 0) * 4 for shape in shapes)
    return {"params_bytes": padded, "grads_bytes": padded,
            "optimizer_bytes": sum(2 * numel(shape, rank) * 4 + 4 for shape in shapes)}


def test_offload_moves_the_shards_and_the_next_update_is_an_un_offloaded_engines_bit_for_bit(run):
    """Offload and onload between updates 2 and 3 (after a forward-only pass, which leaves FSDP2's root
    whole): the engine reshards first, so every parameter is its DTensor again with its local shard freed, as
    are the gradients' and AdamW moments'; a forward is refused meanwhile; the bytes moved are the hand-counted
    shard sizes (`_shard_bytes`), parameters and AdamW state copied, gradients dropped (they come back zero);
    the shards and AdamW state come back bit for bit, also in two steps (gradients and optimizer before the
    weight push, parameters after, as colocated placement does); and the update after it, the final shards,
    AdamW state and push are those of the same engine that never offloaded (verl's use_megatron_fsdp key:
    the oracle), bit for bit."""
    assert LAYOUTS["dp2"][:2] == (1, 1)  # TP1, CP1: DP2 over the two ranks
    for offloaded, never in zip(run[("dp2", True)], run["verl_megatron_fsdp"]):
        trip = offloaded["offload"]
        assert trip["root_whole_before"] and trip["freed"]
        assert trip["refused_while_offloaded"] and "offloaded; call onload() first" in trip["refused_while_offloaded"]
        counted = _shard_bytes([tuple(w.shape) for w in offloaded["params"].values()], offloaded["dp_rank"], 2)
        full = trip["full"]
        assert {k: full[k] for k in counted} == counted
        assert full["bytes"] == counted["params_bytes"] + counted["optimizer_bytes"] == trip["onload"]["bytes"]
        assert full["freed_bytes"] == sum(counted.values())
        assert trip["restored"] and trip["grads_zeroed"]
        first, second = trip["staged"]
        assert trip["params_kept_for_the_push"]
        assert (first["params_bytes"], first["grads_bytes"], first["optimizer_bytes"]) == (
            0, counted["grads_bytes"], counted["optimizer_bytes"])
        assert (second["params_bytes"], second["grads_bytes"], second["optimizer_bytes"]) == (
            counted["params_bytes"], 0, 0)
        assert trip["staged_onload"]["bytes"] == trip["onload"]["bytes"] and trip["staged_restored"]
        assert offloaded["metrics"] == never["metrics"]  # the update after the offload included
        assert _same(offloaded["state"], never["state"])
        assert offloaded["pushed"].keys() == never["pushed"].keys()
        assert all(torch.equal(offloaded["pushed"][k], never["pushed"][k]) for k in never["pushed"])


def _same(a: dict, b: dict) -> bool:
    """{name: {part: tensor}} equal bit for bit, the same names and parts."""
    return a.keys() == b.keys() and all(
        a[n].keys() == b[n].keys() and all(torch.equal(a[n][k], b[n][k]) for k in a[n]) for n in a)


@pytest.mark.parametrize("layout", [*RESUMED, PP_RESUMED, *MOE])
def test_a_resumed_update_is_the_uninterrupted_runs_bit_for_bit(run, layout):
    """Saved after update UPDATES - 1 and loaded into a new engine: its float32 shards and every AdamW
    state tensor (exp_avg, exp_avg_sq, step) are those at the save, and update UPDATES gives the
    uninterrupted run's metrics, shards, Adam state and gathered weights, bit for bit (the oracle: the
    same engine going on without a checkpoint). MoE at EP2: each EP rank its own experts (saved under
    the same local names)."""
    for full, resumed in zip(run[(layout, True)], run[("resume", layout)]):
        at_save = full["at_save"]
        assert at_save["updates"] == resumed["loaded"]["updates"] == UPDATES - 1
        assert {n: set(parts) for n, parts in at_save["state"].items()} == {
            n: {"param", "exp_avg", "exp_avg_sq", "step"} for n in at_save["state"]}
        assert all(parts["step"].item() == UPDATES - 1 for parts in at_save["state"].values())
        assert _same(resumed["loaded"]["state"], at_save["state"])
        assert resumed["loaded"]["lr"] == at_save["lr"]
        assert resumed["metrics"] == full["metrics"][-1]  # every metric, the lr and the grad norm included
        assert _same(resumed["state"], full["state"])
        assert not _same(full["state"], at_save["state"])  # the update changed them
        assert resumed["params"].keys() == full["params"].keys()
        assert all(torch.equal(resumed["params"][n], w) for n, w in full["params"].items())


def saved_tensors(path) -> dict:
    """{key: (shape, dtype)} of a torch_dist checkpoint's model tensors (its metadata, read by torch)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k: (tuple(m.size), m.properties.dtype) for k, m in meta.items()
            if hasattr(m, "size") and not k.startswith("optimizer.")}


def hf_export(path, out, hf_config_dir) -> dict:
    """megarl's HF export of the checkpoint `path` (`convert_torch_dist_to_hf`, as `megarl export`), read
    back with safetensors: {HF name: tensor}."""
    from safetensors.torch import load_file

    from megarl.bridge.convert import convert_torch_dist_to_hf

    convert_torch_dist_to_hf(path, out, hf_config_dir=hf_config_dir)
    exported = {}
    for file in out.glob("*.safetensors"):
        exported.update(load_file(file))
    return exported


@pytest.mark.parametrize("layout", RESUMED)
def test_the_saved_model_is_the_ddp_checkpoints_format_and_exports_to_the_pushed_weights(run, layout, ckpt_root,
                                                                                          tiny_models, tmp_path):
    """The model part: the same tensor keys, shapes and dtypes as megatron's DDP checkpoint of the same
    layout and model dtype (megatron's own save, the oracle of the format); megarl's HF export of it
    (`convert_torch_dist_to_hf`, as `megarl export`) read back with safetensors holds the tensors the
    weight push sent at the save (`weights_for_sync`), bit for bit (the HF config's float32 of a bf16
    checkpoint: exactly the bf16 values)."""
    fsdp2 = saved_tensors(ckpt_root / layout)
    assert len(fsdp2) > 5 and fsdp2 == saved_tensors(ckpt_root / f"{layout}_ddp")
    model_dtype = torch.float32 if LAYOUTS[layout][3] == "float32" else torch.bfloat16
    assert {dtype for _, dtype in fsdp2.values()} == {model_dtype}
    exported = hf_export(ckpt_root / layout, tmp_path / "hf", tiny_models["qwen2"])
    pushed = run[(layout, True)][0]["at_save"]["pushed"]
    assert len(pushed) > 10 and exported.keys() == pushed.keys()
    for name, tensor in pushed.items():
        assert tensor.dtype == model_dtype
        assert torch.equal(exported[name].to(model_dtype), tensor) and torch.equal(exported[name], tensor.float()), name


def test_another_tp_size_refuses_the_optimizer_state_naming_both_layouts_and_loads_the_weights(run, ckpt_root):
    """dp2's checkpoint at TP2: the optimizer-state load is refused (ValueError naming the checkpoint and both
    layouts); the weights alone load (megatron resharding), and the push sends dp2's weights at its save
    bit for bit."""
    for result in run[("resume", "tp2")]:
        message = result["other_refused"]
        assert message and message.startswith(f"{ckpt_root / 'dp2'}: ")
        assert "'tensor_model_parallel_size': 1" in message and "'tensor_model_parallel_size': 2" in message
        assert result["other_updates"] == UPDATES - 1
    other, dp2 = run[("resume", "tp2")][0]["other_pushed"], run[("dp2", True)][0]["at_save"]["pushed"]
    assert len(dp2) > 10 and other.keys() == dp2.keys()
    assert all(torch.equal(other[n], t) for n, t in dp2.items())


def test_a_dp1_resume_reshards_the_dp2_checkpoint(run, ckpt_root, tiny_models):
    """One rank loads dp2's checkpoint (torch.distributed.checkpoint reshards it): its shards and Adam
    moments are the two DP2 shards put together (DTensor's Shard(0) split: concatenated in rank
    order), bit for bit; the next update on the whole batch is the uninterrupted DP2 run's within the
    rounding of another reduction order (test_losses_and_grad_norms_equal_ddps' tolerance)."""
    parts = sorted({r["dp_rank"]: r["old_log_probs"] for r in run[("dp2", True)]}.items())
    one = run_gloo_workers(fsdp2_dp1_resume, 1, args=(str(tiny_models["qwen2"]), str(ckpt_root / "dp2"),
                                                      torch.cat([p for _, p in parts])), timeout_s=200)[0]
    assert one["updates"] == UPDATES - 1
    first, second = (r["at_save"]["state"] for r in run[("dp2", True)])
    whole = {n: {k: (first[n][k] if k == "step" else torch.cat([first[n][k], second[n][k]])) for k in first[n]}
             for n in first}
    assert _same(one["loaded"], whole)
    full = run[("dp2", True)][0]
    assert one["metrics"].keys() == full["metrics"][-1].keys()
    for key in LOSSES + ("actor/grad_norm", "actor/lr"):
        assert one["metrics"][key] == pytest.approx(full["metrics"][-1][key], **tolerance("dp2")), key
    for name, weight in full["params"].items():
        torch.testing.assert_close(one["params"][name], weight, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("layout", PP_LAYOUTS)
def test_pipeline_stages_train_as_with_ddp(run, layout):
    """At PP2 megatron's schedule (1F1B; interleaved with VPP) runs the FSDP2 chunks with no DDP hooks,
    each stage updating its own layers: the losses, gradient norms and learning rates, each stage's
    gathered weights, the log-probs after the updates and each stage's pushed tensors are megatron
    DDP's at the same layout (rel 1e-5); a tied embedding's two copies (the first stage's word
    embedding, the last stage's output layer) stay equal, as DDP's; a non-finite loss skips the
    update on both stages."""
    for stage, (ddp, fsdp) in enumerate(zip(run[(layout, False)], run[(layout, True)])):
        assert fsdp["fsdp2"] and not ddp["fsdp2"] and len(fsdp["metrics"]) == UPDATES
        assert fsdp["schedule_hooks"] == [] and ddp["schedule_hooks"] == ["no_sync_func", "finalize_model_grads_func"]
        for a, b in zip(ddp["metrics"], fsdp["metrics"]):
            assert b["actor/lr"] == a["actor/lr"] and b["actor/skipped_updates"] == 0.0
            for key in LOSSES + ("actor/grad_norm",):
                assert b[key] == pytest.approx(a[key], **tolerance("dp2")), (stage, key, a[key], b[key])
        assert fsdp["metrics"][-1]["actor/pg_loss"] < fsdp["metrics"][0]["actor/pg_loss"]
        assert fsdp["params"].keys() == ddp["params"].keys()
        assert ("embedding.word_embeddings.weight" in fsdp["params"]) == (stage == 0)
        assert any(name.endswith("output_layer.weight") for name in fsdp["params"]) == (stage == 1)
        for name, weight in ddp["params"].items():
            torch.testing.assert_close(fsdp["params"][name], weight, rtol=1e-5, atol=1e-6, msg=name)
        if ddp["scored_after"] is not None:
            torch.testing.assert_close(fsdp["scored_after"]["log_probs"], ddp["scored_after"]["log_probs"],
                                       rtol=1e-5, atol=1e-5)
        assert len(ddp["pushed"]) > 5 and fsdp["pushed"].keys() == ddp["pushed"].keys()
        for name, tensor in ddp["pushed"].items():
            torch.testing.assert_close(fsdp["pushed"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
        assert fsdp["poisoned"] == {"skipped": 1.0, "unchanged": True}
    first, last = run[(PP_RESUMED, True)]  # the tied layout: its two copies after the updates
    ddp_first, ddp_last = run[(PP_RESUMED, False)]
    for stage0, stage1 in ((ddp_first, ddp_last), (first, last)):
        assert torch.equal(stage0["params"]["embedding.word_embeddings.weight"],
                           stage1["params"]["1.output_layer.weight"])


def test_a_pipelines_first_update_is_hfs_loss_and_gradient_norm(run, tiny_models):
    """The first update's gradient norm at PP2 with tied embeddings is HF's over the whole model: summed
    over both stages, the tied embedding HF's one parameter, whose gradient is the sum of the two copies'
    (the word embedding's and the output layer's, all-reduced) counted once."""
    model, vpp = PP_LAYOUTS[PP_RESUMED]
    cfg = pp_config(str(tiny_models[model]), vpp, True)
    loss, norm = hf_first_update(tiny_models[model], training_batch(), run[(PP_RESUMED, True)][0]["old_log_probs"],
                                 cfg)
    first = run[(PP_RESUMED, True)][0]["metrics"][0]
    assert first["actor/actor_loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)
    assert first["actor/grad_norm"] == pytest.approx(norm, rel=1e-5)


def test_a_pipelines_checkpoint_is_per_stage_exports_to_the_pushed_weights_and_refuses_another_pp_size(
        run, ckpt_root, tiny_models, tmp_path):
    """PP_RESUMED's checkpoint: the optimizer state in one DCP directory per TP rank and stage; the model
    part megatron DDP's format at the same layout, its HF export what the two stages pushed at the save
    (bit for bit); dp2's (PP1) optimizer state refused naming both layouts, its weights loaded at PP2
    (megatron resharding) pushing dp2's weights at its save bit for bit. (The resume itself:
    test_a_resumed_update_is_the_uninterrupted_runs_bit_for_bit.)"""
    path = ckpt_root / PP_RESUMED
    assert sorted(p.name for p in (path / "fsdp2_optimizer").iterdir()) == ["layout.json", "tp0_pp0", "tp0_pp1"]
    fsdp2 = saved_tensors(path)
    assert len(fsdp2) > 5 and fsdp2 == saved_tensors(ckpt_root / f"{PP_RESUMED}_ddp")
    pushed = {name: t for rank in run[(PP_RESUMED, True)] for name, t in rank["at_save"]["pushed"].items()}
    exported = hf_export(path, tmp_path / "hf", tiny_models[PP_LAYOUTS[PP_RESUMED][0]])
    assert len(pushed) > 10 and exported.keys() == pushed.keys()
    assert all(torch.equal(exported[name], tensor) for name, tensor in pushed.items())
    for result in run[("resume", PP_RESUMED)]:
        message = result["other_refused"]
        assert message and message.startswith(f"{ckpt_root / 'dp2'}: ")
        assert "'pipeline_model_parallel_size': 1" in message and "'pipeline_model_parallel_size': 2" in message
        assert result["other_updates"] == UPDATES - 1
    other = {name: t for rank in run[("resume", PP_RESUMED)] for name, t in rank["other_pushed"].items()}
    dp2 = run[("dp2", True)][0]["at_save"]["pushed"]
    assert len(dp2) > 10 and other.keys() == dp2.keys()
    assert all(torch.equal(other[n], t) for n, t in dp2.items())
@pytest.mark.parametrize("layout", MOE)
def test_moe_losses_grad_norms_and_weights_equal_ddps(run, layout):
    """A tiny MoE (8 experts, top 2, megatron's load-balancing loss) at DP2, EP2 (expert DP 1) and EP1 (expert
    DP 2): each update's losses and gradient norm (dense and expert gradients, each reduced over its own group)
    are megatron's DDP and chained optimizer's; so are the weights after the updates (each rank's TP / EP
    shards, experts included), the log-probs on them and the pushed HF tensors."""
    ddp, fsdp = run[(layout, False)], run[(layout, True)]
    for a, b in zip(ddp[0]["metrics"], fsdp[0]["metrics"]):
        assert b["actor/skipped_updates"] == 0.0 and b["actor/lr"] == a["actor/lr"]
        for key in LOSSES + ("actor/grad_norm",):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (key, a[key], b[key])
    assert fsdp[0]["metrics"] == fsdp[1]["metrics"]
    assert fsdp[0]["metrics"][-1]["actor/pg_loss"] < fsdp[0]["metrics"][0]["actor/pg_loss"]
    for d, f in zip(ddp, fsdp):
        experts = [n for n in d["params"] if ".mlp.experts." in n]
        assert len(experts) == 2 * 2 * 8 // MOE_LAYOUTS[layout] and d["params"].keys() == f["params"].keys()
        for name, weight in d["params"].items():
            torch.testing.assert_close(f["params"][name], weight, rtol=1e-5, atol=1e-6, msg=name)
        torch.testing.assert_close(f["scored_after"]["log_probs"], d["scored_after"]["log_probs"], rtol=1e-5,
                                   atol=1e-5)
        emits = MOE_LAYOUTS[layout] == 2 or d["dp_rank"] == 0  # at EP2 each EP rank emits its experts
        assert len(d["pushed"]) > 10 if emits else d["pushed"] == {}
        assert f["pushed"].keys() == d["pushed"].keys()
        for name, tensor in d["pushed"].items():
            torch.testing.assert_close(f["pushed"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("layout", MOE)
def test_moe_experts_are_sharded_over_expert_dp(run, layout):
    """The experts' parameters are `Shard(0)` over megatron's expert-DP group (2 / EP ranks: the whole local
    experts at EP2, half their rows at EP1), the rest over DP x CP (2 ranks); the local shard is torch's split."""
    edp = 2 // MOE_LAYOUTS[layout]
    for rank, result in enumerate(run[(layout, True)]):
        for name, s in result["shards"].items():
            mesh = edp if ".mlp.experts." in name else 2
            assert s["shard0"] and s["mesh_size"] == mesh, (name, s["mesh_size"])
            whole = result["params"][name]
            part = torch.chunk(whole, mesh, dim=0)
            index = rank if mesh == 2 else 0
            assert torch.equal(s["local"], part[index] if index < len(part) else whole[:0]), name


def test_moe_routing_replay_trains_as_with_ddp(run):
    """moe_ep2 replays given routes (router_replay R3) in both engines: its log-probs and first gradient norm
    differ from moe_ep1's own routing (so the routes were forced), and test_moe_losses_grad_norms_and_weights_equal_ddps
    holds for it."""
    (replayed,) = MOE_REPLAYED
    (other,) = [n for n in MOE if n != replayed]
    for a, b in zip(run[(replayed, True)], run[(other, True)]):
        assert (a["old_log_probs"] - b["old_log_probs"]).abs().max() > 1e-3
    first = run[(replayed, True)][0]["metrics"][0]["actor/grad_norm"]
    assert first != pytest.approx(run[(other, True)][0]["metrics"][0]["actor/grad_norm"], rel=1e-3)


@pytest.mark.parametrize("layout", MOE)
def test_the_saved_moe_model_is_the_ddp_checkpoints_format_and_exports_to_the_pushed_weights(run, layout, ckpt_root,
                                                                                            moe_models, tmp_path):
    """The MoE's model part: megatron's DDP checkpoint's keys, shapes and dtypes (every expert, gathered over
    expert DP and placed by EP rank); its HF export holds what the push sent at the save (all ranks' pushes
    together: each EP rank its experts), bit for bit."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    from megarl.bridge.convert import convert_torch_dist_to_hf

    def tensors(path) -> dict:  # megatron's chained optimizer's keys: "chained_<i>.optimizer..."
        meta = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        return {k: (tuple(m.size), m.properties.dtype) for k, m in meta.items()
                if hasattr(m, "size") and "optimizer." not in k}

    saved = tensors(ckpt_root / layout)
    assert len(saved) > 5 and saved == tensors(ckpt_root / f"{layout}_ddp")
    convert_torch_dist_to_hf(ckpt_root / layout, tmp_path / "hf", hf_config_dir=moe_models["qwen3_moe"])
    exported = {}
    for file in (tmp_path / "hf").glob("*.safetensors"):
        exported.update(load_file(file))
    pushed = {}
    for result in run[(layout, True)]:
        pushed.update(result["at_save"]["pushed"])
    assert sum(".mlp.experts." in n for n in pushed) == 2 * 8 * 3 and pushed.keys() <= exported.keys()
    assert all(torch.equal(exported[n], t) for n, t in pushed.items())


def test_an_moe_routers_expert_bias_moves_as_with_ddp(run):
    """A tiny GLM-4-MoE (its routers with an expert bias, megatron's update at rate 1e-3) at EP2 DP2: after
    UPDATES updates each router's expert bias is megatron DDP's (its finalize_model_grads update) bit for bit
    on both ranks, and has moved from its initial value; the losses and gradient norms are DDP's. A following
    update with a non-finite loss is skipped in both, and still moves the bias as DDP's does (megatron
    updates it in the schedule, before the optimizer step that is skipped). The counts are sums of whole
    numbers and the update adds sign x rate, so equal routings give equal biases exactly."""
    ddp, fsdp = run[("biased_moe", False)], run[("biased_moe", True)]
    for a, b in zip(ddp[0]["metrics"], fsdp[0]["metrics"]):
        assert b["actor/skipped_updates"] == 0.0 and b["actor/lr"] == a["actor/lr"]
        for key in LOSSES + ("actor/grad_norm",):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), (key, a[key], b[key])
    for d, f in zip(ddp, fsdp):
        # one MoE layer (the first is dense: first_k_dense_replace 1), its router's bias over the 8 experts
        assert len(d["expert_bias"]) == 1 and f["expert_bias"].keys() == d["expert_bias"].keys()
        for name, bias in d["expert_bias"].items():
            assert bias.shape == (8,) and not torch.equal(bias, d["expert_bias_initial"][name]), name
            assert torch.equal(f["expert_bias_initial"][name], d["expert_bias_initial"][name]), name
            assert torch.equal(f["expert_bias"][name], bias), (name, f["expert_bias"][name], bias)
        assert d["poisoned"]["skipped"] == f["poisoned"]["skipped"] == 1.0 and f["poisoned"]["unchanged"]
        for name, bias in d["poisoned"]["expert_bias"].items():
            assert not torch.equal(bias, d["expert_bias"][name]), name
            assert torch.equal(f["poisoned"]["expert_bias"][name], bias), name
    assert all(torch.equal(fsdp[0]["expert_bias"][n], b) for n, b in fsdp[1]["expert_bias"].items())


def test_another_ep_size_refuses_the_optimizer_state_naming_both_layouts_and_loads_the_weights(run, ckpt_root):
    """moe_ep2's checkpoint at EP1: the optimizer-state load is refused (ValueError naming the checkpoint and
    both layouts: each EP rank saved its own experts); the weights alone load (megatron resharding the
    experts), and the push sends moe_ep2's weights at its save (both EP ranks' together) bit for bit."""
    for result in run[("resume", "moe_ep1")]:
        message = result["other_refused"]
        assert message and message.startswith(f"{ckpt_root / 'moe_ep2'}: ")
        assert "'expert_model_parallel_size': 2" in message and "'expert_model_parallel_size': 1" in message
        assert result["other_updates"] == UPDATES - 1
    saved = {}
    for result in run[("moe_ep2", True)]:
        saved.update(result["at_save"]["pushed"])
    other = run[("resume", "moe_ep1")][0]["other_pushed"]
    assert len(saved) > 10 and other.keys() == saved.keys()
    assert all(torch.equal(other[n], t) for n, t in saved.items())


@pytest.mark.parametrize("backend,device", [("gloo", "cpu"), ("nccl", "cuda")])
def test_mesh_device_type_follows_the_backend(backend, device):
    assert mesh_device_type(backend) == device


def test_mesh_device_type_refuses_another_backend():
    with pytest.raises(ValueError, match="megatron.use_torch_fsdp2.*'mpi'"):
        mesh_device_type("mpi")
