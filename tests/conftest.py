"""Test-session settings shared by every folder.

`make test` runs the suite on two pytest-xdist workers with `--dist loadgroup`. Every test gets an
`xdist_group`: its file, so a file's module fixtures (Ray clusters, Megatron worlds, servers) start
once, on one worker; the files with a test that uses an expensive session fixture (SHARED_WORLDS)
share that fixture's group instead, so the world starts once for all of them.
"""
import pytest

# session fixtures that start processes (Megatron ranks, servers) and are used by several files
SHARED_WORLDS = ("sync_run",)


def xdist_groups(items: list[pytest.Item]) -> list[str]:
    """Each test's worker group: the shared world its file uses, else its file (relative to tests/)."""
    files = [item.nodeid.split("::", 1)[0] for item in items]
    world_of_file = {}
    for item, file in zip(items, files):
        for world in SHARED_WORLDS:
            if world in item.fixturenames:
                world_of_file[file] = world
    return [world_of_file.get(file, file) for file in files]


def pytest_collection_modifyitems(config, items):
    for item, group in zip(items, xdist_groups(items)):
        item.add_marker(pytest.mark.xdist_group(group))
