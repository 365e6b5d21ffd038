"""The CPU engine in-process: batched sampling numerics, finish reasons, abort, state rules."""
import os
import shutil
import threading
import time

import pytest
import torch
from transformers import GenerationConfig

from megarl.rollout.cpu.engine import CPUEngine, SchedulerCrash, sample_tokens
from megarl.rollout.protocol import BadRequestError, SamplingParams

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20], [30, 31, 32, 33]]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    torch.set_num_threads(1)
    eng = CPUEngine(tiny_model_dir, max_running_requests=64, random_seed=3)
    yield eng
    eng.shutdown()


def wait_idle(engine, timeout_s=30):
    """Until the scheduler retired its last batch, which it does after the batch's last answer
    went out (as SGLang's scheduler does in its next loop)."""
    deadline = time.monotonic() + timeout_s
    while not engine.is_idle():
        assert time.monotonic() < deadline, f"the engine was not idle within {timeout_s} s"
        time.sleep(0.001)


def run(engine, prompts, sampling, return_logprob=True, timeout_s=60):
    """Submit all prompts at once, wait for every sample; returns [prompt][sample] Sequences."""
    done = threading.Semaphore(0)
    groups = [engine.submit(p, sampling, return_logprob, None, lambda seq: done.release()) for p in prompts]
    for _ in range(sum(len(g) for g in groups)):
        assert done.acquire(timeout=timeout_s), "generation timed out"
    return groups


def test_logprobs_equal_hf_recompute_at_the_sampling_temperature(engine, tiny_hf, helpers):
    # top-k/top-p filter the sampling but not the reported log-prob (SGLang's default); stop ids make
    # rows finish at different steps, so the KV cache is pruned mid-batch.
    sampling = SamplingParams(max_new_tokens=24, temperature=0.7, top_p=0.9, top_k=40, n=3,
                              stop_token_ids=tuple(range(100, 110)), sampling_seed=11)
    groups = run(engine, PROMPTS, sampling)
    lengths, worst = set(), 0.0
    for prompt, seqs in zip(PROMPTS, groups):
        assert len(seqs) == 3
        for seq in seqs:
            assert len(seq.logprobs) == len(seq.output_ids) >= 1
            ref = helpers.hf_logprobs(tiny_hf, prompt, seq.output_ids, 0.7)
            worst = max(worst, (ref - torch.tensor(seq.logprobs)).abs().max().item())
            lengths.add(len(seq.output_ids))
            if seq.finish_reason["type"] == "stop":
                assert seq.finish_reason["matched"] == seq.output_ids[-1] in [1, *range(100, 110)]  # EOS is 1
            else:
                assert seq.finish_reason == {"type": "length", "length": 24}
    assert worst < 1e-4, worst
    assert len(lengths) > 1, "expected rows to finish at different steps"


def test_greedy_matches_hf_generate(engine, tiny_hf):
    sampling = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    groups = run(engine, PROMPTS, sampling)
    config = GenerationConfig(do_sample=False, max_new_tokens=16, min_new_tokens=16, eos_token_id=None, pad_token_id=0)
    for prompt, (seq,) in zip(PROMPTS, groups):
        ref = tiny_hf.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt):].tolist()
        assert seq.output_ids == ref


def test_sampling_seed_makes_samples_reproducible(engine):
    sampling = SamplingParams(max_new_tokens=10, temperature=1.0, n=2, sampling_seed=5, ignore_eos=True)
    first = run(engine, [PROMPTS[0]], sampling)[0]
    again = run(engine, [PROMPTS[0]], sampling)[0]
    assert [s.output_ids for s in first] == [s.output_ids for s in again]
    assert first[0].output_ids != first[1].output_ids  # sample j uses seed + j


def test_finish_on_eos_unless_ignored(engine):
    eos_ids = sorted(engine.eos_token_ids)
    assert eos_ids == [1]
    # EOS is an ordinary token for a random model; make it certain with a one-token stop set instead
    sampling = SamplingParams(max_new_tokens=5, temperature=0.0, stop_token_ids=(99,))
    (seq,) = run(engine, [PROMPTS[0]], sampling)[0]
    greedy_first = seq.output_ids[0]
    stop_on_first = SamplingParams(max_new_tokens=5, temperature=0.0, stop_token_ids=(greedy_first,))
    (seq,) = run(engine, [PROMPTS[0]], stop_on_first)[0]
    assert seq.output_ids == [greedy_first] and seq.finish_reason == {"type": "stop", "matched": greedy_first}
    ignored = SamplingParams(max_new_tokens=5, temperature=0.0, stop_token_ids=(greedy_first,), ignore_eos=True)
    (seq,) = run(engine, [PROMPTS[0]], ignored)[0]
    assert len(seq.output_ids) == 5 and seq.finish_reason == {"type": "length", "length": 5}


def test_zero_new_tokens(engine):
    (seq,) = run(engine, [PROMPTS[0]], SamplingParams(max_new_tokens=0))[0]
    assert seq.output_ids == [] and seq.finish_reason == {"type": "length", "length": 0}


def test_bad_prompts_are_refused_with_reasons(engine):
    with pytest.raises(BadRequestError, match="longer than the model's context length"):
        engine.check_prompt([3] * 256, SamplingParams(max_new_tokens=1))
    with pytest.raises(BadRequestError, match="exceeds the model's maximum context length of 256"):
        engine.check_prompt([3] * 200, SamplingParams(max_new_tokens=100))
    with pytest.raises(BadRequestError, match=r"input_ids\[1\] = 500 is outside the vocabulary"):
        engine.check_prompt([3, 500], SamplingParams())
    with pytest.raises(BadRequestError, match="needs a tokenizer"):
        engine.check_prompt([3], SamplingParams(stop=("x",)))
    with pytest.raises(BadRequestError, match="needs a tokenizer"):
        engine.tokenize("hello")


def test_abort_stops_running_and_waiting_samples(engine):
    done = threading.Semaphore(0)
    long = SamplingParams(max_new_tokens=200, temperature=1.0, ignore_eos=True, n=2)
    seqs = engine.submit(PROMPTS[0], long, True, "long", lambda s: done.release())
    while engine.decode_step == 0:  # tokens reach the Sequence when it finishes
        threading.Event().wait(0.005)
    assert engine.abort(rid="long") == 2
    assert done.acquire(timeout=30) and done.acquire(timeout=30)
    for seq in seqs:
        assert seq.finish_reason["type"] == "abort"
        assert 0 < len(seq.output_ids) < 200 and len(seq.logprobs) == len(seq.output_ids)
    wait_idle(engine)


def test_released_memory_blocks_generation_and_weight_updates(engine):
    wait_idle(engine)
    engine.release_memory(["weights"])
    try:
        with pytest.raises(BadRequestError, match="released"):
            engine.submit(PROMPTS[0], SamplingParams(), False, None, lambda s: None)
        with pytest.raises(BadRequestError, match="weights are released"):
            engine.load_weights([])
    finally:
        engine.resume_memory(["weights"])
    engine.release_memory(["gpu"])  # any tag is taken (SGLang 0.5.23: `offload_tags.add(tag)`), and frees nothing
    assert engine.released == {"gpu"}
    run(engine, [PROMPTS[0]], SamplingParams(max_new_tokens=2))
    engine.resume_memory(["gpu"])


def test_release_needs_an_idle_engine(engine):
    """SGLang 0.5.23 asserts an idle scheduler on release: the assertion ends its server."""
    done = threading.Event()
    seqs = engine.submit(PROMPTS[0], SamplingParams(max_new_tokens=150, ignore_eos=True), False, "busy",
                         lambda s: done.set())
    try:
        with pytest.raises(SchedulerCrash, match="AssertionError: .*only when server is idle"):
            engine.release_memory(None)
    finally:
        engine.abort(rid="busy")
        assert done.wait(30) and seqs[0].finish_reason is not None
    assert engine.released == set()


def test_a_release_as_the_last_answer_goes_out_crashes_as_sglang_does(engine):
    """Issue 49, finding 3: SGLang 0.5.23's scheduler keeps a finished request in `running_batch` /
    `last_batch` until its next loop (`Scheduler.is_fully_idle` false meanwhile), so a release that
    comes after the last answer went out but before that loop fails its idle assertion and ends the
    server. The engine is idle only once its scheduler thread retired the batch: a release from the
    moment the answer goes out (`on_done`, on that thread) crashes, one once it is idle does not."""
    wait_idle(engine)
    seen, done = [], threading.Event()

    def on_done(seq) -> None:  # the scheduler thread, as the request's answer goes out
        seen.append(engine.is_idle())
        try:
            engine.release_memory(None)
        except SchedulerCrash as crash:
            seen.append(str(crash))
        done.set()

    engine.submit(PROMPTS[0], SamplingParams(max_new_tokens=3, ignore_eos=True), False, "last", on_done)
    assert done.wait(30)
    assert seen[0] is False and "only when server is idle" in seen[1], seen
    wait_idle(engine)
    engine.release_memory(None)
    engine.resume_memory(None)


def test_resuming_memory_never_released_crashes_as_sglang_does(engine):
    """SGLang 0.5.23 resumes with `offload_tags.remove(tag)` in the request's order (None: kv_cache,
    weights, cuda_graph): a KeyError at the first tag not released, those before it removed."""
    wait_idle(engine)
    with pytest.raises(SchedulerCrash, match="KeyError: 'weights'"):
        engine.resume_memory(["weights"])
    engine.release_memory(["kv_cache", "cuda_graph"])
    with pytest.raises(SchedulerCrash, match="KeyError: 'weights'"):
        engine.resume_memory(None)  # all tags: kv_cache, then weights
    assert engine.released == {"cuda_graph"}
    engine.resume_memory(["cuda_graph"])
    with pytest.raises(SchedulerCrash, match="KeyError: 'kv_cache'"):
        engine.resume_memory(["kv_cache"])  # twice


def test_load_weights_is_all_or_nothing(engine):
    before = engine.model.lm_head.weight.clone()
    good = ("lm_head.weight", torch.zeros_like(before))
    with pytest.raises(BadRequestError, match="unknown weight name 'model.bogus'"):
        engine.load_weights([good, ("model.bogus", torch.zeros(3))])
    with pytest.raises(BadRequestError, match="has shape"):
        engine.load_weights([good, ("model.norm.weight", torch.zeros(3))])
    assert torch.equal(engine.model.lm_head.weight, before)


def test_sample_tokens_filters_but_reports_unfiltered_logprob():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]] * 2)
    gens = {i: torch.Generator().manual_seed(i) for i in range(2)}
    tokens, logprobs = sample_tokens(logits, torch.tensor([1.0, 0.5]), torch.tensor([1.0, 1.0]),
                                     torch.tensor([1, 1]), gens, torch.Generator())
    assert tokens.tolist() == [0, 0]  # top_k = 1 leaves only the argmax
    expected = torch.log_softmax(logits / torch.tensor([[1.0], [0.5]]), -1)[:, 0]
    assert torch.allclose(logprobs, expected)


def test_sample_tokens_draws_what_per_row_multinomial_draws():
    # The oracle is torch.multinomial itself, called per row as the engine used to: seeded rows on
    # their own generators, the other sampled rows in one call on the shared one, greedy rows none.
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    temperatures = torch.tensor([1.0, 0.0, 0.7, 1.3, 1.0, 0.5])
    top_ps, top_ks = torch.tensor([1.0, 1.0, 0.9, 1.0, 1.0, 0.8]), torch.tensor([50, 50, 50, 7, 50, 50])
    seeds = {0: 11, 1: 12, 3: 13}  # row 1 is greedy: its generator must not draw
    gens = {r: torch.Generator().manual_seed(s) for r, s in seeds.items()}
    ref_gens = {r: torch.Generator().manual_seed(s) for r, s in seeds.items()}
    shared, ref_shared = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(20):
        tokens, _ = sample_tokens(logits, temperatures, top_ps, top_ks, gens, shared)
        probs = torch.softmax(logits / temperatures.clamp(min=1e-9)[:, None], -1)
        sorted_p, order = probs.sort(-1, descending=True)
        cut = (torch.arange(50)[None] >= top_ks[:, None]) | (sorted_p.cumsum(-1) - sorted_p > top_ps[:, None])
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(cut, 0.0))
        expected = logits.argmax(-1)
        expected[[2, 4, 5]] = torch.multinomial(probs[[2, 4, 5]], 1, generator=ref_shared)[:, 0]
        for row in (0, 3):
            expected[row] = torch.multinomial(probs[row], 1, generator=ref_gens[row])[0]
        assert tokens.tolist() == expected.tolist()
    assert torch.equal(gens[1].get_state(), torch.Generator().manual_seed(12).get_state())


@pytest.fixture(scope="module")
def engine_with_tokenizer(tiny_model_dir, tmp_path_factory):
    """The tiny model plus a byte-level, one-character-per-token tokenizer covering its 128 ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny-with-tokenizer")
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(os.path.join(tiny_model_dir, name), path / name)
    # byte-level symbols: printable ASCII, "\u0120" (space), then Latin-1 symbols that map to themselves
    chars = [chr(c) for c in range(33, 127)] + ["\u0120"] + [chr(c) for c in (*range(161, 173), *range(174, 192))]
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    assert len(vocab) == 128
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>", pad_token="<pad>"
    )
    tokenizer.save_pretrained(path)
    eng = CPUEngine(str(path))
    yield eng
    eng.shutdown()


def test_text_input_and_stop_strings_with_a_tokenizer(engine_with_tokenizer):
    eng = engine_with_tokenizer
    assert eng.tokenize("ab c") == [vocab_id for vocab_id in eng.tokenizer("ab c")["input_ids"]] == [67, 68, 97, 69]
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    (seq,) = run(eng, [[5, 6, 7]], greedy)[0]
    assert seq.text == eng.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
    position = next(i for i, t in enumerate(seq.output_ids) if i >= 2 and t >= 3)
    stop_text = eng.tokenizer.decode([seq.output_ids[position]])
    first = next(i for i, t in enumerate(seq.output_ids) if eng.tokenizer.decode([t]) == stop_text)
    stopped_sampling = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True, stop=(stop_text,))
    (stopped,) = run(eng, [[5, 6, 7]], stopped_sampling)[0]
    assert stopped.output_ids == seq.output_ids[: first + 1]
    assert stopped.finish_reason == {"type": "stop", "matched": stop_text}
    assert stopped.text == seq.text[: seq.text.index(stop_text)]  # trimmed, as SGLang does by default


def test_rows_appended_to_a_running_cache_see_what_they_would_alone(engine, tiny_hf):
    """Continuous batching's cache surgery (`kv_cache.append_rows`, `DecodeRows.extend`), both ways:
    a newcomer longer than the running rows (they gain left padding) and a shorter one (it does),
    then a row dropped from the reallocated buffers. Oracle: HF's logits of each row's own unpadded
    sequence, at every greedy step."""
    from megarl.rollout.cpu.engine import Sequence
    from megarl.rollout.cpu.kv_cache import append_rows, can_append_rows

    def seqs(*prompts):
        return [Sequence("r", 0, list(p), SamplingParams(max_new_tokens=12), False, None, None) for p in prompts]

    def check(rows, logits):
        for row, seq in enumerate(rows.seqs):
            full = seq.prompt_ids + rows.token_ids(row)
            with torch.no_grad():
                expected = tiny_hf(input_ids=torch.tensor([full])).logits[0, -1]
            assert torch.allclose(logits[row], expected, atol=1e-5), (row, (logits[row] - expected).abs().max())

    def step(model, rows, cache, logits):
        check(rows, logits)
        tokens = logits.argmax(-1)
        rows.record(tokens, torch.zeros(len(rows)))
        mask = rows.attention_mask(rows.length + 1)
        logits = engine._forward(model, tokens[:, None], mask, rows.next_pos, cache)
        rows.fed()
        return logits

    def join(model, rows, cache, logits, prompts):
        new_rows, new_cache, new_logits = engine._prefill(model, seqs(*prompts), 0)
        append_rows(cache, new_cache, max(rows.length, new_rows.length) + max(rows.remaining(), new_rows.remaining()))
        rows.extend(new_rows)
        return torch.cat([logits, new_logits])

    with engine.exclusive_model() as model, torch.no_grad():
        rows, cache, logits = engine._prefill(model, seqs(PROMPTS[0], PROMPTS[3]), 12)
        assert can_append_rows(cache)
        for _ in range(2):
            logits = step(model, rows, cache, logits)
        assert rows.length == 6
        logits = join(model, rows, cache, logits, [list(range(40, 50))])  # 10 columns > 6: the running rows shift
        assert rows.length == 10 and rows.pad.tolist() == [5, 4, 0]
        for _ in range(2):
            logits = step(model, rows, cache, logits)
        logits = join(model, rows, cache, logits, [PROMPTS[2], PROMPTS[1]])  # 1 and 7 columns < 12: they are padded
        assert rows.pad.tolist() == [5, 4, 0, 11, 5]
        for _ in range(2):
            logits = step(model, rows, cache, logits)
        cache.batch_select_indices(torch.tensor([1, 2, 4]))
        rows.keep([1, 2, 4])
        logits = logits[[1, 2, 4]]
        for _ in range(3):
            logits = step(model, rows, cache, logits)
        check(rows, logits)
        assert rows.counts.tolist() == [9, 7, 5]


def test_a_late_request_joins_the_running_batch_and_samples_as_if_alone(engine, tiny_hf, helpers):
    """A request sent while a long one decodes is admitted into its batch: it finishes first, with
    the tokens (own seed) and log-probs it gets when sent alone, and HF's log-probs."""
    finished, done = [], threading.Semaphore(0)

    def on_done(seq):
        finished.append(seq.rid)
        done.release()

    long = SamplingParams(max_new_tokens=200, temperature=1.0, ignore_eos=True, sampling_seed=1)
    late = SamplingParams(max_new_tokens=8, temperature=0.8, ignore_eos=True, n=2, sampling_seed=7)
    joined = engine.num_joined
    (first,) = engine.submit(PROMPTS[2], long, True, "long", on_done)
    while engine.decode_step == 0:
        threading.Event().wait(0.002)
    late_seqs = engine.submit(PROMPTS[1], late, True, "late", on_done)
    for _ in late_seqs:
        assert done.acquire(timeout=60)
    assert first.finish_reason is None, "the late request waited for the running batch"
    assert finished == ["late", "late"] and engine.num_joined == joined + 2
    engine.abort(rid="long")
    assert done.acquire(timeout=30) and first.finish_reason["type"] == "abort"
    alone = run(engine, [PROMPTS[1]], late)[0]
    for seq, ref in zip(late_seqs, alone):
        assert seq.output_ids == ref.output_ids and len(seq.output_ids) == 8
        assert torch.allclose(torch.tensor(seq.logprobs), torch.tensor(ref.logprobs), atol=1e-5)
        hf = helpers.hf_logprobs(tiny_hf, PROMPTS[1], seq.output_ids, 0.8)
        assert (hf - torch.tensor(seq.logprobs)).abs().max() < 1e-4
    assert late_seqs[0].output_ids != late_seqs[1].output_ids  # seed + sample index


def test_prompts_submitted_together_start_in_one_batch_without_a_burst_wait(tiny_model_dir):
    """With batch_wait_s=0 the scheduler starts a batch at the first request it sees; the prompts
    of one batched request, submitted within `submitting()`, still start together (none joins
    later), however long their submission takes."""
    eng = CPUEngine(tiny_model_dir, batch_wait_s=0.0)
    batches, run_batch = [], eng._run_batch
    eng._run_batch = lambda adapter: (batches.append(len(eng._running)), run_batch(adapter))
    try:
        done = threading.Semaphore(0)
        sampling = SamplingParams(max_new_tokens=4, temperature=0.0)
        with eng.submitting():
            for prompt in PROMPTS:
                eng.submit(prompt, sampling, True, None, lambda seq: done.release())
                time.sleep(0.05)  # the scheduler, woken by the first, would start without the others
        for _ in PROMPTS:
            assert done.acquire(timeout=60)
        assert batches == [len(PROMPTS)] and eng.num_joined == 0
    finally:
        eng.shutdown()


def test_a_weight_update_waits_for_the_batch_and_late_requests_wait_for_the_update(engine, tiny_hf, helpers):
    """Weights change between batches only: an update sent while a batch decodes waits for it, the
    batch takes no newcomers meanwhile, and a request sent then runs on the new weights (oracle:
    HF's model with the same change)."""
    import copy

    original = engine.model.lm_head.weight.clone()
    updated = copy.deepcopy(tiny_hf)
    updated.lm_head.weight.data.mul_(2.0)
    done = threading.Semaphore(0)
    (long,) = engine.submit(PROMPTS[0], SamplingParams(max_new_tokens=200, ignore_eos=True), False, "long",
                            lambda s: done.release())
    try:
        while engine.decode_step == 0:
            threading.Event().wait(0.002)
        update = threading.Thread(target=engine.load_weights, args=([("lm_head.weight", original * 2.0)],))
        update.start()
        while engine._model_waiters == 0:  # the update waits for the batch
            threading.Event().wait(0.002)
        joined = engine.num_joined
        (late,) = engine.submit(PROMPTS[1], SamplingParams(max_new_tokens=6, ignore_eos=True), True, "late",
                                lambda s: done.release())
        threading.Event().wait(0.05)  # decode steps pass: the late request must not join
        engine.abort(rid="long")
        assert done.acquire(timeout=30) and done.acquire(timeout=30)
        update.join(30)
        assert long.finish_reason["type"] == "abort" and engine.num_joined == joined
        expected = helpers.hf_logprobs(updated, PROMPTS[1], late.output_ids, 1.0)
        assert (torch.tensor(late.logprobs) - expected).abs().max() < 1e-4
    finally:
        engine.load_weights([("lm_head.weight", original)])


@pytest.mark.parametrize("sharing, prefill_rows", [(True, 3), (False, 8)])
def test_the_samples_of_a_prompt_share_one_prefill(engine, tiny_hf, sharing, prefill_rows):
    """The prefill runs once per distinct prompt (a request's n samples, and equal prompts of other
    requests), then each row holds its own prompt's keys, values and logits. [0, 5, 6, 7] left-padded
    looks like [5, 6, 7] with its pad id 0: the attention mask keeps them apart. Oracle: HF's logits of
    each row's own sequence, at the prefill and after two greedy steps. With prefix sharing off
    (`rollout.enable_prefix_caching=false`, the server's --disable-radix-cache) every row is
    prefilled on its own, to the same logits."""
    from megarl.rollout.cpu.engine import Sequence

    prompts = [PROMPTS[0]] * 3 + [PROMPTS[1]] * 3 + [[0, 5, 6, 7], PROMPTS[0]]
    seqs = [Sequence("r", 0, list(p), SamplingParams(max_new_tokens=4), False, None, None) for p in prompts]
    forward_rows = []
    hook = engine.model.register_forward_pre_hook(lambda _, args, kwargs: forward_rows.append(len(kwargs["input_ids"])),
                                                  with_kwargs=True)
    engine.prefix_sharing = sharing
    try:
        with engine.exclusive_model() as model, torch.no_grad():
            rows, cache, logits = engine._prefill(model, seqs, 4)
            for step in range(3):
                for row, seq in enumerate(rows.seqs):
                    full = torch.tensor([seq.prompt_ids + rows.token_ids(row)])
                    expected = tiny_hf(input_ids=full).logits[0, -1]
                    assert torch.allclose(logits[row], expected, atol=1e-5), (step, row)
                if step == 2:
                    break
                tokens = logits.argmax(-1)
                rows.record(tokens, torch.zeros(len(rows)))
                logits = engine._forward(model, tokens[:, None], rows.attention_mask(rows.length + 1), rows.next_pos,
                                         cache)
                rows.fed()
    finally:
        hook.remove()
        engine.prefix_sharing = True
    assert forward_rows == [prefill_rows, 8, 8]  # the prefill: 3 distinct prompts (or every row); each decode step: every row
