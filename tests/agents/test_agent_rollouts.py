"""Episodes through the real `openai` client, megarl's endpoint and a real CPU rollout server."""
import asyncio
import socket
from pathlib import Path
from types import SimpleNamespace

import openai
import pytest
import torch

from megarl.agents.loader import load_episode_fn
from megarl.agents.openai_api import SamplingDefaults
from megarl.agents.runner import AgentRunner
from megarl.algos import compute_advantages
from megarl.config import load_and_validate
from megarl.data.parquet import PromptRow
from megarl.data.prompts import Prompt, render_chats
from megarl.data.synthetic import write_task_dataset
from megarl.rewards.dispatch import default_compute_score
from megarl.rollout.client import RolloutClient
from megarl.rollout.protocol import SamplingParams

DEFAULTS = SamplingDefaults(max_new_tokens=6)  # not fixed: episodes pass a seed, so runs are reproducible
REPO = Path(__file__).resolve().parents[2]
CALCULATOR = REPO / "examples" / "agents" / "calculator.py"


def prompts_for(tokenizer, questions):
    out = []
    for i, (q, answer) in enumerate(questions):
        row = PromptRow([{"role": "user", "content": q}], "megarl/add", {"ground_truth": answer})
        out.append(Prompt(i, render_chats(tokenizer, [row.messages])[0], row))
    return out


def make_runner(spy, tokenizer, episode_fn, **kwargs):
    runner = AgentRunner(episode_fn, spy, tokenizer, kwargs.pop("defaults", DEFAULTS), default_compute_score, **kwargs)
    runner.start()
    return runner


async def three_turns(client, sample):
    """Three model calls; between them a tool message naming the episode (tokens the user adds)."""
    messages = list(sample.messages)
    for turn in range(3):
        reply = await client.chat.completions.create(model=sample.model, messages=messages, max_tokens=6,
                                                     seed=1000 * sample.prompt_index + 10 * sample.episode_index + turn)
        tool = f"{sample.prompt_index}{sample.episode_index}{turn}"
        messages += [{"role": "assistant", "content": reply.choices[0].message.content}, {"role": "tool", "content": tool}]
    return {"score": float(sample.episode_index), "turns": 3}


def test_multi_turn_episodes_are_exactly_what_the_server_sampled(spy, tokenizer):
    prompts = prompts_for(tokenizer, [("23+45=", "68"), ("7+8=", "15"), ("50+50=", "100")])
    runner = make_runner(spy, tokenizer, three_turns, n=3, max_concurrent_episodes=9)
    try:
        batch, metrics = runner.generate_and_score(prompts, uid_prefix="s0")
    finally:
        runner.close()
    assert metrics["agent/episodes"] == 9 and metrics["agent/failed_episodes"] == 0, metrics
    assert metrics["agent/turns_mean"] == 3 and metrics["agent/turns/mean"] == 3
    assert len(spy.calls) == 27
    sampled = {(tuple(p), sp.sampling_seed): s for p, sp, s in spy.calls}  # (prompt, seed) -> what was sampled
    assert batch["uid"] == [f"s0-{i}" for i in range(3) for _ in range(3)]
    assert batch["scores"].tolist() == [0.0, 1.0, 2.0] * 3
    for row in range(9):
        prompt = batch["prompt_ids"][row][batch["prompt_mask"][row].bool()].tolist()
        present = batch["response_attention_mask"][row].bool()
        response = batch["response_ids"][row][present].tolist()
        mask = batch["response_mask"][row][present].tolist()
        logprobs = batch["rollout_log_probs"][row][present].tolist()
        assert prompt == prompts[row // 3].input_ids
        # Walk the row: each generated run must be exactly the server's sample for the prefix before it.
        pos, turns, generated = 0, 0, 0
        while pos < len(response):
            if mask[pos] == 0:
                pos += 1
                continue
            seed = 1000 * (row // 3) + 10 * (row % 3) + turns  # the seed this episode used on this turn
            sample = sampled[(tuple(prompt + response[:pos]), seed)]
            end = pos + len(sample.token_ids)
            assert response[pos:end] == sample.token_ids and logprobs[pos:end] == sample.logprobs
            assert all(m == 1 for m in mask[pos:end])
            pos, turns, generated = end, turns + 1, generated + len(sample.token_ids)
        assert turns == 3
        # The loss mask covers exactly the generated tokens: 1 on the three samples, 0 elsewhere.
        assert sum(mask) == generated
        # This episode's own tool outputs are in its row, and no other episode's (episodes never mix).
        episode = (row // 3, row % 3)
        text = tokenizer.decode([t for t, m in zip(response, mask) if m == 0], skip_special_tokens=True)
        assert text == "".join(f"{episode[0]}{episode[1]}{turn}" for turn in range(2))
    # The batch feeds the loop's advantage estimator.
    adv = compute_advantages("grpo", batch["token_level_scores"], batch["response_mask"], uids=batch["uid"]).advantages
    assert torch.all(adv[~batch["response_mask"].bool()] == 0) and adv[batch["response_mask"].bool()].abs().sum() > 0


def test_crashing_hanging_and_over_limit_episodes_are_counted_and_the_step_completes(spy, tokenizer):
    async def episode(client, sample):
        messages = list(sample.messages)
        if sample.episode_index == 0:
            raise RuntimeError("user code crashed")
        if sample.episode_index == 1:
            await client.chat.completions.create(model=sample.model, messages=messages, seed=1)
            await asyncio.sleep(3600)  # hangs
        if sample.episode_index == 2:
            for turn in range(5):  # max_turns is 2: the third call is refused and this raises
                reply = await client.chat.completions.create(model=sample.model, messages=messages, seed=turn)
                messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                             {"role": "user", "content": "again"}]
        if sample.episode_index == 3:
            return "not a score"
        reply = await client.chat.completions.create(model=sample.model, messages=messages, seed=4)
        return None  # scored by the rule reward on the last reply

    prompts = prompts_for(tokenizer, [("23+45=", "68")])
    runner = make_runner(spy, tokenizer, episode, n=5, max_turns=2, episode_timeout_s=3.0)
    try:
        batch, metrics = runner.generate_and_score(prompts)
    finally:
        runner.close()
    assert metrics["agent/failed_episodes"] == 3
    assert (metrics["agent/failed/exception"], metrics["agent/failed/timeout"], metrics["agent/failed/bad_return"]) == (1, 1, 1)
    assert metrics["agent/truncated_episodes"] == 1 and metrics["agent/limit_hits"] == 1
    assert batch["agent_status"] == ["failed", "failed", "truncated", "failed", "ok"]
    mask = batch["response_mask"]
    assert mask[[0, 1, 3]].sum() == 0 and mask[2].sum() > 0 and mask[4].sum() > 0
    assert batch["scores"][:4].tolist() == [0.0] * 4
    assert batch["token_level_scores"][[0, 1, 3]].abs().sum() == 0
    assert len(batch) == 5 and batch["prompt_ids"].shape[0] == 5


def test_streaming_errors_models_and_loopback(spy, tokenizer):
    runner = make_runner(spy, tokenizer, three_turns)
    endpoint = runner.endpoint
    try:
        assert endpoint.host == "127.0.0.1"
        assert endpoint._server.servers[0].sockets[0].getsockname()[0] == "127.0.0.1"
        other = _non_loopback_address()
        if other is not None:  # nothing listens for the endpoint on another interface
            with pytest.raises(OSError), socket.create_connection((other, endpoint.port), timeout=2):
                pass

        async def calls():
            client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key="x", max_retries=0)
            messages = [{"role": "user", "content": "23+45="}]
            plain = await client.chat.completions.create(model="policy", messages=messages, seed=5, logprobs=True)
            stream = await client.chat.completions.create(model="policy", messages=messages, seed=5, stream=True,
                                                          stream_options={"include_usage": True})
            pieces, usage, finish = [], None, None
            async for chunk in stream:
                if chunk.choices:
                    pieces.append(chunk.choices[0].delta.content or "")
                    finish = chunk.choices[0].finish_reason or finish
                usage = chunk.usage or usage
            ids = render_chats(tokenizer, [messages])[0]  # the same prompt as token ids
            text = await client.completions.create(model="policy", prompt=ids, seed=5, stream=True)
            text_pieces = [c.choices[0].text async for c in text]
            models = await client.models.list()
            errors = []
            for bad in ({"n": 2}, {"extra_body": {"bogus": 1}},
                        {"extra_headers": {"X-Megarl-Trajectory": "no-such-episode"}}):
                with pytest.raises(openai.BadRequestError) as e:
                    await client.chat.completions.create(model="policy", messages=messages, **bad)
                errors.append(e.value)
            await client.close()
            return plain, pieces, usage, finish, text_pieces, models, errors

        plain, pieces, usage, finish, text_pieces, models, errors = asyncio.run(calls())
    finally:
        runner.close()
    assert "".join(pieces) == plain.choices[0].message.content == "".join(text_pieces)
    assert finish == plain.choices[0].finish_reason and usage.completion_tokens == plain.usage.completion_tokens
    assert [t.logprob for t in plain.choices[0].logprobs.content] == spy.calls[0][2].logprobs
    assert [m.id for m in models.data] == ["policy"]
    assert errors[0].body["param"] == "n" and errors[1].body["param"] == "bogus"
    assert errors[2].body["code"] == "unknown_trajectory"


def _non_loopback_address():
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the outgoing interface
            address = s.getsockname()[0]
    except OSError:
        return None
    return None if address.startswith("127.") else address


def test_the_calculator_example_masks_the_tool_reply(spy, tokenizer):
    prompts = prompts_for(tokenizer, [("23+45=", "68"), ("7+8=", "15")])
    runner = make_runner(spy, tokenizer, load_episode_fn(str(CALCULATOR)), n=4, max_turns=2,
                         defaults=SamplingDefaults(max_new_tokens=4, fixed=True))
    try:
        batch, metrics = runner.generate_and_score(prompts)
    finally:
        runner.close()
    assert metrics["agent/failed_episodes"] == 0, metrics
    assert "agent/success/mean" in metrics and batch["turns"] == [2 if s == 0.0 or s == 0.5 else 1 for s in batch["scores"].tolist()]
    for row in range(8):
        present = batch["response_attention_mask"][row].bool()
        ids, mask = batch["response_ids"][row][present].tolist(), batch["response_mask"][row][present].tolist()
        added = tokenizer.decode([t for t, m in zip(ids, mask) if m == 0], skip_special_tokens=True)
        question, truth = [("23+45=", "68"), ("7+8=", "15")][row // 4]
        assert added == ("" if batch["turns"][row] == 1 else f"?{truth[0]}{question}")


def test_validation_sampling_replaces_the_training_sampling_and_greedy_episodes_repeat(spy, tokenizer):
    """The calculator's episodes with `sampling` (greedy, n=1) on a runner that trains at temperature
    1 with n=4: every call of the episodes is greedy, one episode per prompt, twice the same."""
    prompts = prompts_for(tokenizer, [("23+45=", "68"), ("7+8=", "15"), ("50+50=", "100")])
    runner = make_runner(spy, tokenizer, load_episode_fn(str(CALCULATOR)), n=4, max_turns=2,
                         defaults=SamplingDefaults(max_new_tokens=4, temperature=1.0, fixed=True))
    greedy = SamplingParams(max_new_tokens=3, temperature=0.0, n=1)
    try:
        first, metrics = runner.generate_and_score(prompts, uid_prefix="val", sampling=greedy)
        calls = list(spy.calls)
        second, _ = runner.generate_and_score(prompts, uid_prefix="val", sampling=greedy)
        spy.calls.clear()
        runner.generate_and_score(prompts[:1])  # training sampling again
    finally:
        runner.close()
    assert len(first) == 3 and first["uid"] == ["val-0", "val-1", "val-2"]
    assert metrics["agent/failed_episodes"] == 0 and metrics["agent/turns_mean"] > 1, metrics  # tool calls happened
    assert len(calls) == sum(first["turns"]) > len(prompts)
    assert all(sp.temperature == 0.0 and sp.max_new_tokens == 3 for _, sp, _ in calls)
    for key in ("response_ids", "response_mask", "scores"):
        assert torch.equal(first[key], second[key]), key
    assert len(spy.calls) >= 4 and all(sp.temperature == 1.0 and sp.max_new_tokens == 4 for _, sp, _ in spy.calls)


def calculator_trainer(cpu_server, tiny_dir, tokenizer, tmp_path, *overrides: str):
    """An RLTrainer of configs/tiny/agent_calculator.yaml with 6 validation prompts, given the real
    rollout client only (validation of an agent run touches no training worker)."""
    from megarl.trainer.rl import RLTrainer  # imports megatron: only the tests using it pay for it

    files = write_task_dataset("add", tmp_path / "data", train_size=16, val_size=6, sft_size=0, seed=0)
    config = load_and_validate(REPO / "configs" / "tiny" / "agent_calculator.yaml", [
        f"actor_rollout_ref.model.path={tiny_dir}", f"data.train_files=[{files['train']}]",
        f"data.val_files=[{files['val']}]", f"actor_rollout_ref.rollout.agent.path={CALCULATOR}", *overrides])
    cluster = SimpleNamespace(rollout=SimpleNamespace(client=RolloutClient(cpu_server.url, max_retries=1)), teacher=None)
    return RLTrainer(config, cluster, tokenizer, default_compute_score)


def test_rl_trainer_validates_an_agent_run_with_its_episodes(cpu_server, tiny_dir, tokenizer, tmp_path):
    """RLTrainer.validate of the calculator config runs one greedy and one sampled episode per
    validation prompt through the agent runner (the trainer is given the real rollout client only:
    validation of an agent run touches no training worker)."""
    trainer = calculator_trainer(cpu_server, tiny_dir, tokenizer, tmp_path)
    try:
        first, second = trainer.validate(), trainer.validate()
    finally:
        trainer.agent.close()
    source = "megarl/add"
    assert {"val/score", f"val/{source}/score", "val/sampled_score", "val/agent/episodes", "val/agent/turns_mean",
            "val/agent/failed_episodes", "val/agent/success/mean"} <= set(first), sorted(first)
    assert first["val/agent/episodes"] == 6 and first["val/agent/failed_episodes"] == 0
    assert first["val/agent/turns_mean"] > 1  # the calculator tool answered: more than one model call per prompt
    assert first["val/score"] == first[f"val/{source}/score"] and 0 <= first["val/sampled_score"] <= 1
    for key in ("val/score", "val/agent/turns_mean", "val/agent/success/mean", "val/agent/generated_tokens_mean"):
        assert first[key] == second[key], key  # greedy episodes repeat exactly


def test_validation_with_several_samples_reports_the_best_of_each_prompt(cpu_server, tiny_dir, tokenizer, tmp_path):
    trainer = calculator_trainer(cpu_server, tiny_dir, tokenizer, tmp_path, "actor_rollout_ref.rollout.val_kwargs.n=3",
                                 "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
                                 "actor_rollout_ref.rollout.val_kwargs.temperature=1.0")
    try:
        m = trainer.validate()
    finally:
        trainer.agent.close()
    assert m["val/agent/episodes"] == 18  # 3 per validation prompt
    assert {"val/best@3/score", "val/best@3/megarl/add/score"} <= set(m), sorted(m)
    assert m["val/score"] <= m["val/best@3/score"] <= 1
