"""`describe_actor_death`: the one line a dead rank's error gives, from Ray's message texts."""
from megarl.placement.worker_group import describe_actor_death

KILLED = (
    "The actor died unexpectedly before finishing this task.\n\tclass_name: TrainWorker\n\tactor_id: 6364\n"
    "\tpid: 1892\n\tnamespace: d92f\n\tip: 10.0.0.3\nThe actor is dead because its worker process has died. "
    "Worker exit type: SYSTEM_ERROR Worker exit detail: Worker unexpectedly exits with a connection error code 2. "
    "End of file. Some common causes include: (1) the process was killed by the OOM killer due to high memory usage"
)


def test_a_killed_worker_names_its_process_address_and_likely_cause():
    assert describe_actor_death(KILLED) == (
        "the worker process (pid 1892, node 10.0.0.3) exited unexpectedly (SIGKILL, the OOM killer or a crash?); "
        "Ray: SYSTEM_ERROR: Worker unexpectedly exits with a connection error code 2."
    )


def test_other_deaths():
    killed_on_purpose = KILLED.replace("SYSTEM_ERROR", "INTENDED_USER_EXIT")
    assert describe_actor_death(killed_on_purpose).startswith(
        "the worker process (pid 1892, node 10.0.0.3) was stopped on purpose (ray.kill or exit_actor); Ray: ")
    assert "was lost with its node" in describe_actor_death(KILLED.replace("SYSTEM_ERROR", "NODE_DIED"))
    init = "The actor died because of an error raised in its creation task, ray::TrainWorker.__init__() ..."
    assert describe_actor_death(init) == f"the worker process failed while starting: {init}"
    assert describe_actor_death("something new") == "the worker process is gone: something new"
