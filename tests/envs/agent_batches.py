"""What the connector tests read from an agent batch: the replies an OpenAI client saw and the
generated token runs with their log-probs."""


def reply_text(tokenizer, run: list[int]) -> str:
    """The reply an OpenAI client reads for a sampled run: its ids decoded with special tokens kept, less the
    <eos> that ended it (the endpoint's rule: megarl.agents.openai_api.completion_text)."""
    if run and run[-1] == tokenizer.eos_token_id:
        run = run[:-1]
    return tokenizer.decode(run, skip_special_tokens=False)


def generated_runs(batch, row):
    """The generated token runs (loss mask 1) of a batch row, in order, with their log-probs."""
    present = batch["response_attention_mask"][row].bool()
    ids, mask = batch["response_ids"][row][present].tolist(), batch["response_mask"][row][present].tolist()
    logprobs = batch["rollout_log_probs"][row][present].tolist()
    runs, start = [], None
    for pos, m in enumerate(mask + [0]):
        if m and start is None:
            start = pos
        if not m and start is not None:
            runs.append((start, ids[start:pos], logprobs[start:pos]))
            start = None
    return ids, runs
