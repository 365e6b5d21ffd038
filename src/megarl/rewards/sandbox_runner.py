"""Child side of the code sandbox: run as `python -I sandbox_runner.py '<json settings>'`.

Standard library only; it is executed as a script, never imported. In order it:
1. sets resource limits: address space, CPU seconds, size of any file written (stdout is a
   file, so this also caps the output), no core dumps;
2. enters a new network namespace (only a loopback that is down) when asked and the kernel
   allows it, and records whether it did in `<scratch>/.netns`;
3. installs an audit hook, which cannot be removed from Python, refusing: sockets, ctypes,
   starting or signalling processes, changing resource limits, and writing, creating,
   renaming or deleting files outside the scratch directory;
4. runs the solution file as `__main__` with the scratch directory as working directory.

Exit status: the program's own, 1 for an uncaught exception, 2 for an uncaught AssertionError
(a failed test assertion).
"""
import json
import os
import resource
import sys
import traceback

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000

BLOCKED_PREFIXES = ("socket.", "ctypes.")
BLOCKED_EVENTS = {
    "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill", "os.killpg",
    "subprocess.Popen", "pty.spawn", "resource.setrlimit", "resource.prlimit", "signal.pthread_kill",
    "sys.remote_exec",
}
PATH_EVENTS = {  # event -> how many leading arguments are paths
    "os.remove": 1, "os.rmdir": 1, "os.mkdir": 1, "os.chmod": 1, "os.chown": 1, "os.truncate": 1,
    "os.utime": 1, "os.rename": 2, "os.link": 2, "os.symlink": 2, "shutil.rmtree": 1, "shutil.copyfile": 2,
    "shutil.copytree": 2, "shutil.move": 2, "shutil.chown": 1, "os.chflags": 1, "os.lchflags": 1,
}
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def set_limits(memory_bytes: int, cpu_seconds: int, max_file_bytes: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def enter_network_namespace() -> bool:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
    return libc.unshare(flags) == 0


def make_audit_hook(scratch: str):
    scratch = os.path.realpath(scratch)

    def inside(path) -> bool:
        if isinstance(path, int):  # a file descriptor already open
            return True
        try:
            real = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return False
        return real == scratch or real.startswith(scratch + os.sep) or real == os.devnull

    def hook(event, args):
        if event in BLOCKED_EVENTS or event.startswith(BLOCKED_PREFIXES):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            writing = (mode is not None and any(c in mode for c in "wax+")) or (
                isinstance(flags, int) and flags & WRITE_FLAGS)
            if writing and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the scratch directory is not allowed")
        elif event in PATH_EVENTS:
            for path in args[:PATH_EVENTS[event]]:
                if not inside(path):
                    raise PermissionError(f"sandbox: {event} on {path!r} outside the scratch directory is not allowed")

    return hook


def main() -> None:
    settings = json.loads(sys.argv[1])
    scratch = settings["scratch"]
    set_limits(settings["memory_bytes"], settings["cpu_seconds"], settings["max_file_bytes"])
    isolated = settings["isolate_network"] and enter_network_namespace()
    with open(os.path.join(scratch, ".netns"), "w") as f:
        f.write("1" if isolated else "0")
    with open(settings["source_path"]) as f:
        code = compile(f.read(), "solution.py", "exec")
    os.chdir(scratch)
    sys.argv = ["solution.py"]
    sys.dont_write_bytecode = True
    sys.addaudithook(make_audit_hook(scratch))
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except AssertionError:
        traceback.print_exc()
        sys.exit(2)
    except BaseException:
        traceback.print_exc()
        sys.exit(1)


if __name__ == "__main__":
    main()
