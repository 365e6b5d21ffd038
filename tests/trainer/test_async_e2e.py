"""Asynchronous modes end to end on CPU (one tiny split cluster: a TP=1 actor on one logical GPU,
one CPU-engine server on the other): which weights generated which batch, as the servers
themselves report it (`meta_info.weight_version`); exact resume from a checkpoint that holds a
generated, not yet trained batch; the staleness bound of fully_async."""
import asyncio
import os
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from megarl.checkpoint import complete_checkpoints
from megarl.workers.rollout_worker import RolloutWorker
from megarl.workers.train_worker import TrainWorker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

COMPARED = ("actor/", "reward/", "response_length/", "advantages/", "async/staleness")
STEPS = 3
PARTIAL_STEPS = 2  # the partial-rollout runs: rollout 1, cut by step 0's push, is trained at step 2


class Recorder:
    """A tracker that keeps what it is given (the trainer's `tracker.log`)."""

    def __init__(self):
        self.rows: dict[int, dict] = {}

    def log(self, metrics: dict, step: int) -> None:
        self.rows[step] = dict(metrics)


def spy_on_rollouts(trainer) -> list:
    """Every rollout the producer generates, in order, as (index, version, the servers' weight
    versions of its samples)."""
    seen, generate = [], trainer.producer.rollouts._generate

    def recording(index, version, prompt_indices):
        rollout = generate(index, version, prompt_indices)
        seen.append((index, version, {s.weight_version for per_prompt in rollout.samples for s in per_prompt}))
        return rollout

    trainer.producer.rollouts._generate = recording
    return seen


def compared(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.startswith(COMPARED)}


def up_to_last_bits(expected: dict):
    """`expected`'s compared metrics, to compare with another row's up to float32's last bits: the CPU engine batches
    the requests that arrive together, and a sample's rollout log-probs (the TIS weights') differ in
    their last bits with the batch's shape (same tokens; measured: 2.891605854 vs 2.891605616 for
    one prompt alone or beside two others). Which requests arrive together depends on timing."""
    return pytest.approx(compared(expected), rel=1e-5, abs=1e-7)


@pytest.fixture(scope="module")
def split_cluster(ray_two_gpus, tiny_assets, tiny_grpo_cluster, tmp_path_factory):
    out = tmp_path_factory.mktemp("async")
    with tiny_grpo_cluster(
        tiny_assets, out, "placement.mode=split", "placement.rollout_gpus=1",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=1", "async_training.mode=one_step_off",
        "actor_rollout_ref.actor.tis_imp_ratio_cap=2.0",  # the off-policy correction async modes need
        f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1", "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "actor_rollout_ref.rollout.prompt_length=72",  # servers' context 80: room for the partial rollout's 64 tokens
        f"custom_reward_function.path={Path(__file__).with_name('varied_reward.py')}",
    ) as (cluster, trainer):
        yield cluster, trainer, out


def new_trainer(trainer, trainer_keys: dict, **async_training):
    """Another controller on the same cluster, with `trainer.*` and `async_training.*` keys changed."""
    from megarl.trainer.rl import RLTrainer

    c = trainer.config
    config = replace(c, trainer=replace(c.trainer, **trainer_keys),
                     async_training=replace(c.async_training, **async_training))
    return RLTrainer(config, trainer.cluster, trainer.tokenizer, trainer.score_fn)


@pytest.fixture(scope="module")
def one_step_off_run(split_cluster):
    """The fixture's one_step_off trainer fit for STEPS steps (a checkpoint at every step), once, for
    the tests that resume from it: (the rollouts it generated as `spy_on_rollouts` records them,
    its rows, the uids of the batches it trained)."""
    _, trainer, _ = split_cluster
    seen = spy_on_rollouts(trainer)
    uids = record_takes(trainer, lambda batch, metrics: list(batch["uid"]))
    tracker = Recorder()
    trainer.fit(tracker)
    return seen, tracker.rows, uids


def test_one_step_off_generates_step_k_plus_1_with_weights_k_and_resumes_exactly(split_cluster, one_step_off_run):
    cluster, trainer, out = split_cluster
    seen, rows, _ = one_step_off_run
    # Rollout j (step j+1's batch) came from the weights of step j-1 (rollouts 0 and 1 from the
    # initial ones): the servers say so, and every sample of a batch from one version (the
    # push waited for the generation in flight).
    assert [(index, version) for index, version, _ in seen] == [(0, 0), (1, 0), (2, 1)]
    assert [labels for _, _, labels in seen] == [{"default"}, {"default"}, {"1"}]
    assert [rows[s]["async/staleness_max"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert all(rows[s]["actor/grad_norm"] > 0 for s in (1, 2, 3))
    assert all(rows[s]["timing/generate_hidden_s"] >= 0 for s in (1, 2, 3))

    # Resume from step 1's checkpoint: it holds rollout 1, generated with the weights of step 0,
    # which no checkpoint holds; steps 2 and 3 are those of the uninterrupted run.
    step_dirs = dict(complete_checkpoints(out / "megarl-tiny" / "grpo"))
    resumed = new_trainer(trainer, {})
    resumed.load_state_dict(cluster.load_checkpoint(step_dirs[1]))
    assert [(r.index, r.version) for r in resumed.producer.rollouts.ready] == [(1, 0)]
    seen_after = spy_on_rollouts(resumed)
    again = Recorder()
    resumed.fit(again)
    assert sorted(again.rows) == [2, 3]
    assert [(index, version) for index, version, _ in seen_after] == [(2, 1)]
    for step in (2, 3):
        assert compared(again.rows[step]) == up_to_last_bits(rows[step]), f"step {step} differs"


def stopped_by_sigterm(run, index: int) -> tuple:
    """Fit `run` (resumed at step 1) until a real SIGTERM to this process, sent by the producer
    thread as it starts rollout `index` while the controller trains, stops it after step 2:
    (the uids of the batches it trained, its rows, the checkpoint main_ppo resumes from)."""
    from megarl.checkpoint import find_resume_dir
    from megarl.trainer.preemption import Preempted

    generate, signalled = run.producer.rollouts._generate, []

    def signalling(i, version, prompt_indices, partial=None):
        if i == index and not signalled:
            signalled.append(threading.current_thread() is not threading.main_thread())
            os.kill(os.getpid(), signal.SIGTERM)
        return generate(i, version, prompt_indices, partial)

    run.producer.rollouts._generate = signalling
    uids = record_takes(run, lambda batch, metrics: list(batch["uid"]))
    rows = Recorder()
    with pytest.raises(Preempted) as stop:
        run.fit(rows)
    assert signalled == [True] and stop.value.signum == signal.SIGTERM and stop.value.step == 2
    assert sorted(rows.rows) == [2]  # the step it was in finished; the next did not start
    resume_dir = find_resume_dir(run.config)  # what main_ppo resumes from (`latest`)
    assert str(resume_dir) == stop.value.checkpoint and resume_dir.name == "global_step_2"
    return uids, rows, resume_dir


def test_one_step_off_stopped_by_sigterm_mid_generation_resumes_with_the_uninterrupted_batches(
        split_cluster, one_step_off_run):
    """A real SIGTERM to this process while the producer generates rollout 2 and step 2 trains
    (the test_resume_e2e path, in process: a subprocess run costs minutes of start-up here): the
    step finishes, the push waits for rollout 2, the checkpoint holds it, and the resumed run
    trains step 3 on it. Steps 2 and 3 (metrics and uids) equal the uninterrupted run's
    (`one_step_off_run`, whose step 1 checkpoint the stopped run starts from)."""
    cluster, trainer, out = split_cluster
    _, expected_rows, expected_uids = one_step_off_run
    step_1 = dict(complete_checkpoints(out / "megarl-tiny" / "grpo"))[1]

    keys = {"experiment_name": "sigterm", "save_freq": -1, "resume_mode": "auto"}  # only the stop's checkpoint
    stopped = new_trainer(trainer, keys)
    stopped.load_state_dict(cluster.load_checkpoint(step_1))
    uids, first, resume_dir = stopped_by_sigterm(stopped, 2)

    resumed = new_trainer(trainer, keys)
    resumed.load_state_dict(cluster.load_checkpoint(resume_dir))
    assert [(r.index, r.version) for r in resumed.producer.rollouts.ready] == [(2, 1)]  # weights no checkpoint holds
    uids_after = record_takes(resumed, lambda batch, metrics: list(batch["uid"]))
    second = Recorder()
    resumed.fit(second)
    assert sorted(second.rows) == [3]
    assert uids + uids_after == expected_uids[1:]
    assert compared(first.rows[2]) == up_to_last_bits(expected_rows[2])
    assert compared(second.rows[3]) == up_to_last_bits(expected_rows[3])


FULLY_ASYNC = {"total_training_steps": 4, "experiment_name": "fully_async"}


def pinned(run):
    """`run` with its schedule pinned (`fill_window`: each push waits until every rollout the gate
    allows has run, as when generation outpaces training): rollout j from version max(0, j - K)."""
    run.producer.rollouts.fill_window = True
    return run


@pytest.fixture(scope="module")
def fully_async_run(split_cluster):
    """A fully_async run (max_staleness 2, 4 steps, a checkpoint at every step) with its schedule
    pinned, once, for the tests below: (the rollouts it generated as `spy_on_rollouts` records
    them, their samples' (tokens, log-probs) by index, its rows, the uids of the batches it trained)."""
    _, trainer, _ = split_cluster
    run = pinned(new_trainer(trainer, FULLY_ASYNC, mode="fully_async", max_staleness=2))
    seen = spy_on_rollouts(run)
    samples, generate = {}, run.producer.rollouts._generate

    def keeping(index, version, prompt_indices, partial=None):
        rollout = generate(index, version, prompt_indices, *([] if partial is None else [partial]))
        samples[index] = [(s.token_ids, s.logprobs) for per_prompt in rollout.samples for s in per_prompt]
        return rollout

    run.producer.rollouts._generate = keeping
    uids = record_takes(run, lambda batch, metrics: list(batch["uid"]))
    tracker = Recorder()
    run.fit(tracker)
    return seen, samples, tracker.rows, uids


def test_fully_async_never_trains_past_max_staleness_and_resumes_its_buffer_exactly(split_cluster, fully_async_run):
    """On the pinned run (`fully_async_run`): every rollout the gate allows is generated before a
    push, so the gate is met at its bound (a gate that let one more start would show staleness 3)."""
    cluster, trainer, out = split_cluster
    seen, _, rows, _ = fully_async_run
    staleness = [rows[s]["async/staleness_max"] for s in (1, 2, 3, 4)]
    assert max(staleness) <= 2 and all(rows[s]["async/dropped_samples"] == 0 for s in (1, 2, 3, 4))
    # The gate: rollout j started at a version of at least j - 2; trained at version j.
    assert all(version >= index - 2 for index, version, _ in seen)
    assert staleness == [float(i - v) for i, v, _ in seen[:4]]

    # Resumed (the schedule not pinned) from step 2's checkpoint, the batches it had generated are
    # trained exactly as in the uninterrupted run (which versions generate the later ones depends on
    # timings).
    resumed = new_trainer(trainer, FULLY_ASYNC, mode="fully_async", max_staleness=2)
    resumed.load_state_dict(cluster.load_checkpoint(dict(complete_checkpoints(out / "megarl-tiny" / "fully_async"))[2]))
    buffered = [(r.index, r.version) for r in resumed.producer.rollouts.ready]
    assert buffered and buffered == [(i, v) for i, v, _ in seen if i in dict(buffered)]
    again = Recorder()
    resumed.fit(again)
    assert sorted(again.rows) == [3, 4]
    for index, _ in buffered:
        step = index + 1
        assert compared(again.rows[step]) == up_to_last_bits(rows[step]), f"step {step} differs"


def test_fully_async_stopped_by_sigterm_resumes_with_the_uninterrupted_batches(split_cluster, fully_async_run):
    """fully_async (max_staleness 2) stopped by a real SIGTERM while the producer generates rollout
    3 and step 1 trains: the step finishes, the push waits for rollout 3, and the checkpoint holds
    the buffer (rollouts 2 and 3: their tokens, rollout log-probs and versions 0 and 1, weights no
    checkpoint holds). The resumed run trains steps 3 and 4 on them: batches and losses equal an
    uninterrupted run's (`fully_async_run`, whose step 1 checkpoint the stopped run starts from).

    Which version generates a rollout after the checkpoint depends on timing in fully_async (two
    uninterrupted runs may differ there), so both runs pin the schedule with `fill_window`:
    rollout j from version max(0, j - 2) in every run. What is exact by design is what the
    checkpoint holds: every rollout generated and not yet trained, trained as it would have been."""
    cluster, trainer, out = split_cluster
    seen, generated, expected_rows, expected_uids = fully_async_run
    assert [(index, version) for index, version, _ in seen] == [(0, 0), (1, 0), (2, 0), (3, 1)]
    assert [expected_rows[s]["async/staleness_max"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 2.0, 2.0]
    step_1 = dict(complete_checkpoints(out / "megarl-tiny" / "fully_async"))[1]

    keys = {**FULLY_ASYNC, "experiment_name": "fully_async_sigterm", "save_freq": -1, "resume_mode": "auto"}
    stopped = pinned(new_trainer(trainer, keys, mode="fully_async", max_staleness=2))
    stopped.load_state_dict(cluster.load_checkpoint(step_1))
    assert [(r.index, r.version) for r in stopped.producer.rollouts.ready] == [(1, 0), (2, 0)]
    uids, first, resume_dir = stopped_by_sigterm(stopped, 3)

    resumed = pinned(new_trainer(trainer, keys, mode="fully_async", max_staleness=2))
    resumed.load_state_dict(cluster.load_checkpoint(resume_dir))
    assert [(r.index, r.version) for r in resumed.producer.rollouts.ready] == [(2, 0), (3, 1)]
    for r in resumed.producer.rollouts.ready:  # the samples themselves, as the uninterrupted run generated them
        tokens, logprobs = zip(*[(s.token_ids, s.logprobs) for per_prompt in r.samples for s in per_prompt])
        assert list(tokens) == [t for t, _ in generated[r.index]]
        assert sum(logprobs, []) == pytest.approx(sum((lp for _, lp in generated[r.index]), []), abs=1e-5)
    uids_after = record_takes(resumed, lambda batch, metrics: list(batch["uid"]))
    second = Recorder()
    resumed.fit(second)
    assert sorted(second.rows) == [3, 4]
    assert uids + uids_after == expected_uids[1:]
    for step, row in ((2, first.rows[2]), (3, second.rows[3]), (4, second.rows[4])):
        assert compared(row) == up_to_last_bits(expected_rows[step]), f"step {step} differs"


def kill_once_busy(control, pid: int, timeout_s: float = 60.0) -> None:
    """SIGKILL the server process `pid` as soon as it reports requests running (mid-generation)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and control.server_info()["internal_states"][0]["num_running_requests"] == 0:
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)


def timed_rollouts(generate, seconds: dict):
    """`generate` (a producer's `_generate`) that also keeps each uninterrupted rollout's wall seconds,
    by index, in `seconds`."""
    def timed(index, version, prompt_indices, partial=None):
        start = time.monotonic()
        rollout = generate(index, version, prompt_indices, partial)
        if partial is None:
            seconds.setdefault(index, time.monotonic() - start)
        return rollout

    return timed


def some_tokens_in(seconds: dict) -> None:
    """Wait a third of rollout 0's generation (the same batch and lengths as the one running, which the
    push's work beside it only slows): some of the running rollout's tokens are generated, most are
    not. A fixed wait is not: a CI machine generated the 64 tokens within 0.2 s."""
    time.sleep(seconds[0] / 3)


def record_takes(run, keep) -> list:
    """Make `run.producer.take` append `keep(batch, metrics)` of every batch it hands the step, in
    order, to the list returned."""
    kept, take = [], run.producer.take

    def recording_take(timer):
        batch, metrics = take(timer)
        kept.append(keep(batch, metrics))
        return batch, metrics

    run.producer.take = recording_take
    return kept


def test_a_server_killed_during_an_async_generation_is_restarted_between_steps_and_nothing_is_lost(split_cluster):
    """The server dies while the producer generates rollout 2 and the controller trains step 1:
    it is restarted by the controller (not the producer thread), the lost requests are resent, and
    the trained batches are those of the uninterrupted schedule, each prompt once."""
    from megarl.data.sampler import EpochSampler
    from megarl.rollout.control import ServerControl

    cluster, trainer, _ = split_cluster
    run = new_trainer(trainer, {"experiment_name": "server_death", "save_freq": -1})
    fleet = cluster.rollout
    fleet.client.max_retries = 1  # give up on the dead server quickly (the fleet's own logic is under test)
    victim = fleet.workers.call(RolloutWorker.status, timeout_s=30)[0]
    restarts_before, killers, generate = fleet.restarts[0], [], run.producer.rollouts._generate
    restarting_threads = []
    recover = cluster.recover

    def recording_recover(*args, **kwargs):
        restarting_threads.append(threading.current_thread() is threading.main_thread())
        return recover(*args, **kwargs)

    resumed = []

    def killing(index, version, prompt_indices, partial=None):
        resumed.append(partial is not None)
        if index == 2 and partial is None:
            killers.append(threading.Thread(target=kill_once_busy, args=(ServerControl(victim["url"], fleet.api_key), victim["pid"])))
            killers[-1].start()
        return generate(index, version, prompt_indices, partial)

    trained = record_takes(run, lambda batch, metrics: list(batch["uid"]))
    run.producer.rollouts._generate, cluster.recover = killing, recording_recover
    tracker = Recorder()
    try:
        run.fit(tracker)
    finally:
        del cluster.recover  # the cluster's own method again
        fleet.client.max_retries = 5
        for killer in killers:
            killer.join(timeout=60)
    now = fleet.workers.call(RolloutWorker.status, timeout_s=30)[0]
    assert now["running"] and now["pid"] != victim["pid"] and fleet.restarts[0] == restarts_before + 1
    assert sum(tracker.rows[s]["faults/rollout_server_restarts"] for s in (1, 2, 3)) == 1
    assert resumed.count(True) == 1  # rollout 2 was cut short and finished after the restart
    assert restarting_threads and all(restarting_threads)  # only the controller's thread restarts servers
    # The oracle: the sampler's batches of an uninterrupted run, step by step, each prompt once.
    sampler = EpochSampler.from_config(run.config.data, len(run.train_data))
    n = run.config.actor_rollout_ref.rollout.n
    expected = [[f"s{step}-{p}" for p in sampler.next_batch() for _ in range(n)] for step in range(STEPS)]
    assert trained == expected
    assert all(tracker.rows[s]["actor/grad_norm"] > 0 for s in (1, 2, 3))


def partial_run(trainer, monkeypatch, name: str, data=None, **trainer_keys):
    """A fully_async controller with partial rollouts (max_staleness 1) on the fixture's cluster,
    whose training responses are 64 tokens (ignore_eos): long enough to be caught mid-generation.
    `data`: another `data` config; `trainer_keys`: more `trainer.*` keys."""
    from megarl.trainer import rl

    sampling = rl.sampling_params
    monkeypatch.setattr(rl, "sampling_params", lambda config, validation=False: replace(
        sampling(config, validation), ignore_eos=not validation))
    c = trainer.config
    config = replace(c, data=data or c.data, actor_rollout_ref=replace(c.actor_rollout_ref, rollout=replace(
        c.actor_rollout_ref.rollout, response_length=64)))
    keys = {"total_training_steps": PARTIAL_STEPS, "experiment_name": name, "save_freq": -1, **trainer_keys}
    return rl.RLTrainer(replace(config, trainer=replace(c.trainer, **keys),
                                async_training=replace(c.async_training, mode="fully_async", max_staleness=1,
                                                       partial_rollout=True)),
                        trainer.cluster, trainer.tokenizer, trainer.score_fn)


def test_fully_async_partial_rollout_continues_a_generation_across_a_push(split_cluster, monkeypatch):
    """A push interrupts rollout 1 mid-generation (/pause_generation abort, push, /continue_generation):
    its samples continue with the new weights, the tokens carry both versions in the trained batch,
    the rollout log-probs are the servers' own (per token, from the weights that sampled it), and
    training proceeds. Rollout 1 starts only when step 0 reaches its push, so the push finds it
    running; responses are 64 tokens (ignore_eos), so it is caught mid-generation."""
    from megarl.rollout.control import ServerControl

    cluster, trainer, _ = split_cluster
    run = partial_run(trainer, monkeypatch, "partial")
    fleet, control = cluster.rollout, ServerControl(cluster.rollout.urls[0], cluster.rollout.api_key)
    seconds = {}
    push_due, generate, produced = threading.Event(), timed_rollouts(run.producer.rollouts._generate, seconds), {}
    fleet.client.continue_aborted = True  # the fleet's client was built by the fixture's config

    def late(index, version, prompt_indices, partial=None):
        if index == 1:
            assert push_due.wait(300), "step 0 never reached its push"
        produced[index] = generate(index, version, prompt_indices, partial)
        return produced[index]

    pause, pauses = fleet.pause_generation, []

    def pause_once_running():
        if not pauses:
            push_due.set()
            deadline = time.monotonic() + 120
            while control.server_info()["internal_states"][0]["num_running_requests"] == 0:
                assert time.monotonic() < deadline, "rollout 1 never ran"
                time.sleep(0.005)
            some_tokens_in(seconds)  # from the first weights
        pauses.append(time.monotonic())
        return pause()

    trained = record_takes(run, lambda batch, metrics: (batch, metrics))
    run.producer.rollouts._generate, fleet.pause_generation = late, pause_once_running
    tracker = Recorder()
    try:
        run.fit(tracker)
    finally:
        fleet.pause_generation, fleet.client.continue_aborted = pause, False
    assert len(pauses) == PARTIAL_STEPS  # every push paused the servers
    batch, metrics = trained[1]
    crossing = [v for v in batch["weight_versions"] if len(set(v)) > 1]
    pushed = str(int(tracker.rows[1]["sync/weight_version"]))  # step 0's push, the one that interrupted
    for v in crossing:  # the servers' weights before the push, then the pushed ones
        switch = v.index(pushed)
        assert 0 < switch and len(set(v[:switch])) == 1 and set(v[switch:]) == {pushed}
    assert crossing and metrics["async/partial_rollouts"] == len(crossing)
    assert tracker.rows[2]["async/partial_rollouts"] == len(crossing)
    assert tracker.rows[2]["async/rollout_version"] == 0.0  # the rollout keeps the version it started with
    samples = [s for per_prompt in produced[1].samples for s in per_prompt]
    for row, s in enumerate(samples):  # the correction's rollout log-probs are the servers' own, per token
        assert len(s.logprobs) == len(s.token_ids) == len(batch["weight_versions"][row])
        assert batch["rollout_log_probs"][row, :len(s.logprobs)].tolist() == pytest.approx(s.logprobs)
    assert all(tracker.rows[s]["actor/grad_norm"] > 0 for s in (1, 2))


def test_partial_rollout_push_tolerates_a_server_dying_after_the_dead_server_check(split_cluster, monkeypatch):
    """The server is killed by PID just after step 0's dead-server check found it alive, while
    rollout 1 runs on it: the push's /pause_generation finds it dead, so the push waits for the
    generation instead (cut short, it parks), restarts the server and pushes; step 1 sends only
    the lost prompts again. Each prompt is trained once, in the uninterrupted schedule's batches."""
    from megarl.data.sampler import EpochSampler
    from megarl.rollout.control import ServerControl

    cluster, trainer, _ = split_cluster
    run = partial_run(trainer, monkeypatch, "partial_death")
    fleet = cluster.rollout
    victim = fleet.workers.call(RolloutWorker.status, timeout_s=30)[0]
    control, restarts_before = ServerControl(victim["url"], fleet.api_key), fleet.restarts[0]
    running, generate, resumed = threading.Event(), run.producer.rollouts._generate, []

    def late(index, version, prompt_indices, partial=None):
        resumed.append((index, partial is not None))
        if index == 1 and partial is None:  # starts only once step 0 is at its push
            assert running.wait(300), "step 0 never reached its push"
        return generate(index, version, prompt_indices, partial)

    dead_servers, pause, paused = fleet.dead_servers, fleet.pause_generation, []

    def killed_after_the_check():
        found = dead_servers()
        if threading.current_thread() is threading.main_thread() and not running.is_set():
            running.set()  # the check of step 0's push: rollout 1 starts; kill its server once it runs
            kill_once_busy(control, victim["pid"])
            deadline = time.monotonic() + 60
            while not dead_servers():
                assert time.monotonic() < deadline, "the killed server still reads as running"
        return found

    def recording_pause():
        paused.append(pause())
        return paused[-1]

    trained = record_takes(run, lambda batch, metrics: list(batch["uid"]))
    run.producer.rollouts._generate, fleet.dead_servers, fleet.pause_generation = late, killed_after_the_check, recording_pause
    fleet.client.continue_aborted, fleet.client.max_retries = True, 1
    max_restarts, fleet.max_restarts = fleet.max_restarts, fleet.max_restarts + 1  # other tests restart it too
    tracker = Recorder()
    try:
        run.fit(tracker)
    finally:
        fleet.dead_servers, fleet.pause_generation = dead_servers, pause
        fleet.client.continue_aborted, fleet.client.max_retries, fleet.max_restarts = False, 5, max_restarts
    now = fleet.workers.call(RolloutWorker.status, timeout_s=30)[0]
    assert now["running"] and now["pid"] != victim["pid"] and fleet.restarts[0] == restarts_before + 1
    assert sum(tracker.rows[s]["faults/rollout_server_restarts"] for s in (1, 2)) == 1
    assert paused == [False, True]  # step 0's push found the server dead; the next one paused
    assert (1, True) in resumed  # rollout 1 was cut short and finished after the restart
    sampler = EpochSampler.from_config(run.config.data, len(run.train_data))
    n = run.config.actor_rollout_ref.rollout.n
    assert trained == [[f"s{step}-{p}" for p in sampler.next_batch() for _ in range(n)]
                       for step in range(PARTIAL_STEPS)]
    assert all(tracker.rows[s]["actor/grad_norm"] > 0 for s in (1, 2))


def test_validation_beside_a_continued_partial_rollout_runs_outside_the_pause_window(split_cluster, monkeypatch):
    """Step 0's push aborts rollout 1 mid-generation; its samples are continued only once the
    validation after step 1 has begun, so both run on the server together. Validation runs
    between steps, never inside a push's /pause_generation .. /continue_generation window: none
    of its answers is aborted or spans two weight versions, all are from the weights just pushed,
    and the continued samples end with those weights."""
    from megarl.rollout.control import ServerControl

    cluster, trainer, _ = split_cluster
    c = trainer.config
    val_file = str(Path(c.data.train_files[0]).with_name("val.parquet"))
    run = partial_run(trainer, monkeypatch, "partial_validation", replace(c.data, val_files=[val_file]),
                      total_training_steps=2, test_freq=1)
    fleet, control = cluster.rollout, ServerControl(cluster.rollout.urls[0], cluster.rollout.api_key)
    timeline, validations = [], []  # (event, time); (server version, answers) per validation
    push_due, validating, continued = threading.Event(), threading.Event(), threading.Event()
    generate_rollout, pause, resume, generate = run.producer.rollouts._generate, fleet.pause_generation, \
        fleet.continue_generation, fleet.generate
    continue_sample = fleet.client._continue

    def late(index, version, prompt_indices, partial=None):
        if index == 1:  # starts only once step 0 is at its push
            assert push_due.wait(300), "step 0 never reached its push"
        return generate_rollout(index, version, prompt_indices, partial)

    def pause_once_running():
        if not push_due.is_set():
            push_due.set()
            deadline = time.monotonic() + 120
            while control.server_info()["internal_states"][0]["num_running_requests"] == 0:
                assert time.monotonic() < deadline, "rollout 1 never ran"
                time.sleep(0.005)
        timeline.append(("pause", time.monotonic()))
        return pause()

    def recording_continue():
        resume()
        timeline.append(("continue", time.monotonic()))

    async def continue_during_validation(session, index, prompt, sampling, j, sample, return_logprob):
        if sample.finish_reason == "abort":  # aborted by step 0's push: wait for the validation
            deadline = time.monotonic() + 300
            while not validating.is_set():
                assert time.monotonic() < deadline, "no validation started"
                await asyncio.sleep(0.005)
            continued.set()
        return await continue_sample(session, index, prompt, sampling, j, sample, return_logprob)

    def validation_generate(prompts, sampling, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            return generate(prompts, sampling, *args, **kwargs)  # the producer's
        timeline.append(("validation", time.monotonic()))
        validating.set()
        if len(validations) == 0:
            assert continued.wait(300), "rollout 1 was not continued"
        result = generate(prompts, sampling, *args, **kwargs)
        timeline.append(("validated", time.monotonic()))
        validations.append((fleet.weight_version, result.samples))
        return result

    trained = record_takes(run, lambda batch, metrics: batch["weight_versions"])
    run.producer.rollouts._generate, fleet.generate = late, validation_generate
    fleet.client._continue = continue_during_validation
    fleet.pause_generation, fleet.continue_generation = pause_once_running, recording_continue
    fleet.client.continue_aborted = True
    tracker = Recorder()
    try:
        run.fit(tracker)
    finally:
        fleet.pause_generation, fleet.continue_generation, fleet.generate = pause, resume, generate
        fleet.client.continue_aborted, fleet.client._continue = False, continue_sample
    events = [name for name, _ in timeline]
    # per step: its push (pause, continue), then its validation (greedy, then one sampled)
    assert events == ["pause", "continue", "validation", "validated", "validation", "validated"] * 2, events
    pushed = str(int(tracker.rows[1]["sync/weight_version"]))
    for version, samples in validations:
        answers = [s for per_prompt in samples for s in per_prompt]
        assert answers and all(s.finish_reason != "abort" and s.weight_versions is None for s in answers)
        assert {s.weight_version for s in answers} == {version}
    assert validations[0][0] == pushed and "val/score" in tracker.rows[1] and "val/score" in tracker.rows[2]
    # rollout 1 (trained at step 2), started before step 0's push, ended with the pushed weights
    assert tracker.rows[2]["async/rollout_version"] == 0.0
    assert all(v[-1] == pushed and len(set(v)) <= 2 for v in trained[1])


def test_partial_rollout_server_killed_during_the_push_after_the_pause_is_restarted_and_its_requests_resubmitted(
        split_cluster, monkeypatch):
    """Step 0's push pauses the server (abort) while rollout 1 runs on it: its requests come back
    aborted and wait at the paused server as continuations (prompt + tokens so far). Once they
    wait there, the server is killed by PID as the push is sent (the event: the actor's
    push_weights call), so they are lost with it and the push fails. The push restarts the
    server, paused as the fleet is, and the client's continuations, sent again from their tokens,
    reach it before the second push (held until then: the event is the restarted server holding a
    request). They wait there for the pushed weights: every token of rollout 1 is from the weights
    it started with or the pushed ones, none from the restarted server's initial ones (negative
    control: a restarted server not paused answers them with those), the prompts sent again are
    counted, and each prompt is trained once, in the uninterrupted schedule's batches."""
    from megarl.data.sampler import EpochSampler
    from megarl.rollout.control import ServerControl

    cluster, trainer, _ = split_cluster
    run = partial_run(trainer, monkeypatch, "partial_push_death")
    fleet = cluster.rollout
    victim = fleet.workers.call(RolloutWorker.status, timeout_s=30)[0]
    control = ServerControl(victim["url"], fleet.api_key)
    if fleet.weight_version is None:  # the servers' weights must differ from those a restart loads
        cluster.sync_weights()
    started, restarts_before = control.weight_version(), fleet.restarts[0]
    seconds = {}
    push_due, generate = threading.Event(), timed_rollouts(run.producer.rollouts._generate, seconds)

    def late(index, version, prompt_indices, partial=None):
        if index == 1 and partial is None:  # starts only once step 0 is at its push
            assert push_due.wait(300), "step 0 never reached its push"
        return generate(index, version, prompt_indices, partial)

    def state(key: str) -> int:
        return control.server_info()["internal_states"][0][key]

    def wait_for(condition, what: str) -> None:
        deadline = time.monotonic() + 120
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.005)

    pause, paused = fleet.pause_generation, []

    def pause_once_running():
        if not push_due.is_set():
            push_due.set()
            wait_for(lambda: state("num_running_requests") > 0, "rollout 1 never ran")
            some_tokens_in(seconds)  # from the first weights
        paused.append(pause())
        return paused[-1]

    workers, call, pushes = cluster.actor.workers, cluster.actor.workers.call, []

    def killing_push(method, *args, **kwargs):
        if method is TrainWorker.push_weights:
            pushes.append(method)
            if len(pushes) == 1:  # step 0's push, after its pause, with the continuations waiting
                wait_for(lambda: state("num_waiting_requests") > 0, "no continuation waited at the paused server")
                os.kill(victim["pid"], signal.SIGKILL)
                wait_for(lambda: fleet.dead_servers(), "the killed server still reads as running")
            elif len(pushes) == 2:  # the push again, to the restarted server: once a request reached it
                wait_for(lambda: state("num_waiting_requests") + state("num_running_requests")
                         + state("num_finished_requests") > 0, "nothing was sent again to the restarted server")
        return call(method, *args, **kwargs)

    trained = record_takes(run, lambda batch, metrics: (list(batch["uid"]), batch["weight_versions"], metrics))
    run.producer.rollouts._generate, fleet.pause_generation, workers.call = late, pause_once_running, killing_push
    # partial rollouts on; continuations retried long enough to outlast the restart (backoff up to 10 s)
    fleet.client.continue_aborted, fleet.client.max_retries = True, 12
    max_restarts, fleet.max_restarts = fleet.max_restarts, fleet.restarts[0] + 1  # other tests restart it too
    tracker = Recorder()
    try:
        run.fit(tracker)
    finally:
        fleet.pause_generation, fleet.max_restarts = pause, max_restarts
        fleet.client.continue_aborted, fleet.client.max_retries = False, 5
        del workers.call
    now = fleet.workers.call(RolloutWorker.status, timeout_s=30)[0]
    assert now["running"] and now["pid"] != victim["pid"] and fleet.restarts[0] == restarts_before + 1
    assert sum(tracker.rows[s]["faults/rollout_server_restarts"] for s in (1, 2)) == 1
    assert paused == [True, True] and len(pushes) == PARTIAL_STEPS + 1  # step 0 pushed twice
    sampler = EpochSampler.from_config(run.config.data, len(run.train_data))
    n = run.config.actor_rollout_ref.rollout.n
    assert [uids for uids, _, _ in trained] == [
        [f"s{step}-{p}" for p in sampler.next_batch() for _ in range(n)] for step in range(PARTIAL_STEPS)]
    # rollout 1 (trained at step 2): the weights it started with, then the pushed ones, never others
    pushed = str(int(tracker.rows[1]["sync/weight_version"]))
    _, versions, metrics = trained[1]
    assert all(set(v) <= {started, pushed} for v in versions), [sorted(set(v)) for v in versions]
    crossing = [row for row, v in enumerate(versions) if len(set(v)) > 1]  # continued from their tokens
    assert crossing and metrics["async/partial_rollouts"] == len(crossing)
    assert metrics["rollout/retried_requests"] == len({row // n for row in crossing})  # sent again: counted
    assert all(tracker.rows[s]["actor/grad_norm"] > 0 for s in (1, 2))
