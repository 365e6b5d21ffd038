"""Every flag megarl passes to SGLang, and every endpoint its client calls, checked against SGLang
0.5.23's own definitions, read from the wheel without importing sglang (it needs a GPU stack).

The oracle: `pip download sglang==0.5.23 --no-deps` (a 39 MB wheel, about a second from PyPI),
cached under the repository's ignored `outputs/.cache/` so it downloads once. SGLang builds its
parser in `sglang/srt/server_args.py::ServerArgs.add_cli_args`: `add_cli_args_from_dataclass`
(`sglang/srt/arg_groups/arg_utils.py`) turns every field of the namespace structs in
`sglang/srt/arg_groups/fields/*.py` annotated `A[T, "help"]` or `A[T, Arg(...)]` into
`--field-name` (or `Arg.cli_name`) plus `Arg.aliases`, skips `Arg(no_cli=True)`, and makes a bool
field a `store_true` switch; then a few flags are added by hand with `parser.add_argument`.
The routes are the `@app.get/post/api_route` decorators of `sglang/srt/entrypoints/http_server.py`.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from megarl.rollout.launch import LoraServing, MultiNode, SpeculativeDecoding, sglang_server_command

SGLANG_VERSION = "0.5.23"
REPO = Path(__file__).resolve().parents[2]
CACHE = REPO / "outputs" / ".cache" / f"sglang-{SGLANG_VERSION}-wheel"
SWITCH, VALUE, VALUES, UNKNOWN = "switch", "value", "values", "unknown"  # VALUES: nargs "*" or "+"


def sglang_wheel() -> Path:
    """The sglang wheel, downloaded once into CACHE (fails the test if PyPI cannot be reached)."""
    found = sorted(CACHE.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    if not found:
        CACHE.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", f"sglang=={SGLANG_VERSION}", "--no-deps", "--only-binary=:all:",
             "-d", str(CACHE)],
            capture_output=True, text=True, timeout=600,
        )
        assert done.returncode == 0, f"pip download sglang=={SGLANG_VERSION} failed:\n{done.stdout}\n{done.stderr}"
        found = sorted(CACHE.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    assert found, f"no sglang {SGLANG_VERSION} wheel in {CACHE}"
    return found[0]


# ----------------------------------------------------------------------------- flags
def _constant(node):
    return node.value if isinstance(node, ast.Constant) else None


def _field_flags(tree: ast.Module) -> dict[str, str]:
    """Flags generated from annotated struct fields, as arg_utils.add_cli_args_from_dataclass does."""
    flags = {}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        for stmt in cls.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            ann = stmt.annotation
            if not (isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name)
                    and ann.value.id in ("A", "Annotated") and isinstance(ann.slice, ast.Tuple)):
                continue
            inner, *metadata = ann.slice.elts
            arg = None  # the first Arg(...) or bare help string, as _unwrap_annotated takes it
            for m in metadata:
                if isinstance(_constant(m), str):
                    arg = {}
                    break
                if isinstance(m, ast.Call) and isinstance(m.func, ast.Name) and m.func.id == "Arg":
                    arg = {k.arg: k.value for k in m.keywords}
                    break
            if arg is None or _constant(arg.get("no_cli")) is True:
                continue
            names = [_constant(arg["cli_name"]) if "cli_name" in arg else "--" + stmt.target.id.replace("_", "-")]
            if isinstance(arg.get("aliases"), ast.List):
                names += [_constant(e) for e in arg["aliases"].elts]
            if "action" in arg:
                kind = UNKNOWN
            elif _constant(arg.get("nargs")) in ("*", "+"):
                kind = VALUES
            else:
                text = ast.unparse(inner).replace(" ", "")
                kind = SWITCH if text in ("bool", "Optional[bool]", "bool|None") else VALUE
            flags.update(dict.fromkeys(names, kind))
    return flags


def _hand_added_flags(tree: ast.Module) -> dict[str, str]:
    """Flags added with parser.add_argument("--...", ...)."""
    flags = {}
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        if not (isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument"):
            continue
        names = [_constant(a) for a in call.args if isinstance(_constant(a), str) and _constant(a).startswith("--")]
        action = next((k.value for k in call.keywords if k.arg == "action"), None)
        kind = VALUE if action is None else SWITCH if _constant(action) in ("store_true", "store_false") else UNKNOWN
        flags.update(dict.fromkeys(names, kind))
    return flags


def sglang_flags(wheel: Path) -> dict[str, str]:
    """{flag: switch | value | unknown} of `python -m sglang.launch_server`."""
    flags = {}
    with zipfile.ZipFile(wheel) as z:
        sources = [n for n in z.namelist() if re.fullmatch(r"sglang/srt/arg_groups/fields/[^/]+\.py", n)]
        assert len(sources) >= 10, f"the wheel's layout changed: {sources}"
        for name in sources:
            flags.update(_field_flags(ast.parse(z.read(name))))
        server_args = ast.parse(z.read("sglang/srt/server_args.py"))
        flags.update(_field_flags(server_args))
        flags.update(_hand_added_flags(server_args))
    return flags


def flag_problems(command: list[str], flags: dict[str, str]) -> list[str]:
    """What in a `-m sglang.launch_server` command SGLang's parser would not take as megarl means it."""
    args = command[command.index("sglang.launch_server") + 1:]
    problems = []
    last_flag = None
    for i, token in enumerate(args):
        if not token.startswith("--"):
            after_flag = i > 0 and args[i - 1].startswith("--") and flags.get(args[i - 1]) != SWITCH
            if not (after_flag or flags.get(last_flag) == VALUES):
                problems.append(f"{token!r} is not a flag's value")
            continue
        last_flag = token
        kind = flags.get(token)
        if kind is None:
            problems.append(f"{token} is not a flag of sglang {SGLANG_VERSION}")
            continue
        has_value = i + 1 < len(args) and not args[i + 1].startswith("--")
        if kind == SWITCH and has_value:
            problems.append(f"{token} is a switch but is given {args[i + 1]!r}")
        if kind in (VALUE, VALUES) and not has_value:
            problems.append(f"{token} needs a value")
    return problems


def every_command() -> dict[str, list[str]]:
    """sglang_server_command on each of its code paths (and all together)."""
    full = dict(host="10.0.0.1", tp_size=16, ep_size=8, attn_dp_size=2, base_gpu_id=3, mem_fraction_static=0.6,
                enable_memory_saver=True,
                api_key="k", dtype="bfloat16", context_length=4096, random_seed=7, deterministic=True,
                return_routed_experts=True, multi_node=MultiNode(2, 1, "10.0.0.1:29500"),
                lora=LoraServing(8, ("q_proj", "down_proj")), speculative=SpeculativeDecoding("EAGLE", 3, 1, 4),
                prefix_caching=False)
    commands = {"defaults": sglang_server_command("/m", 30000)}
    for key, value in full.items():
        commands[key] = sglang_server_command("/m", 30000, **{key: value})
    commands["all"] = sglang_server_command("/m", 30000, **full)
    on_cpu = {k: v for k, v in full.items() if k not in ("enable_memory_saver", "deterministic", "speculative")}
    commands["cpu"] = sglang_server_command("/m", 30000, device="cpu", context_length=256, max_running_requests=8)
    commands["cpu, all"] = sglang_server_command("/m", 30000, device="cpu", max_running_requests=8, **on_cpu)
    return commands


@pytest.fixture(scope="module")
def wheel():
    return sglang_wheel()


@pytest.fixture(scope="module")
def flags(wheel):
    return sglang_flags(wheel)


def test_the_oracle_reads_sglangs_own_definitions(flags):
    """Known facts of 0.5.23 (reference/gpu-cluster-path.md §4): fields, an alias, hand-added
    flags, switches and valued flags; and no-CLI fields stay out."""
    assert len(flags) > 300
    for flag in ("--model-path", "--tp-size", "--tensor-parallel-size", "--nnodes", "--node-rank",
                 "--dist-init-addr", "--nccl-init-addr", "--sampling-backend", "--reasoning-parser"):
        assert flags[flag] == VALUE, flag
    for flag in ("--enable-memory-saver", "--enable-deterministic-inference", "--skip-server-warmup",
                 "--enable-weights-cpu-backup"):
        assert flags[flag] == SWITCH, flag
    assert "--radix-eviction-policy-explicitly-set" not in flags  # Arg(no_cli=True)
    assert flags["--enable-lora"] == SWITCH and flags["--max-lora-rank"] == VALUE
    assert flags["--lora-target-modules"] == VALUES  # Arg(nargs="*")
    assert flags["--ep-size"] == flags["--expert-parallel-size"] == flags["--ep"] == VALUE  # fields/parallel.py


def test_an_expert_parallel_server_gets_sglangs_ep_flag_and_the_default_none(flags):
    """rollout.expert_parallel_size reaches SGLang as `--ep-size N` beside `--tp-size`; at 1 (SGLang's
    own default, fields/parallel.py ep_size = 1) the command carries no EP flag."""
    command = sglang_server_command("/m", 30000, tp_size=8, ep_size=4)
    assert flag_problems(command, flags) == []
    assert command[command.index("--ep-size") + 1] == "4" and command[command.index("--tp-size") + 1] == "8"
    assert not {"--ep-size", "--expert-parallel-size", "--ep"} & set(sglang_server_command("/m", 30000, tp_size=8))


def test_attention_data_parallelism_gets_sglangs_attn_dp_flag_and_the_default_none(flags):
    """rollout.attention_data_parallel_size reaches SGLang as `--attn-dp-size N` beside `--tp-size`
    (fields/parallel.py attn_dp_size, alias --attention-data-parallel-size); at 1 (SGLang's default)
    the command carries no attention-DP flag."""
    command = sglang_server_command("/m", 30000, tp_size=8, ep_size=8, attn_dp_size=4)
    assert flag_problems(command, flags) == []
    assert command[command.index("--attn-dp-size") + 1] == "4" and command[command.index("--tp-size") + 1] == "8"
    assert flags["--attn-dp-size"] == flags["--attention-data-parallel-size"] == VALUE
    assert not {"--attn-dp-size", "--attention-data-parallel-size", "--dp-size", "--enable-dp-attention"} & set(
        sglang_server_command("/m", 30000, tp_size=8, ep_size=8))


@pytest.mark.parametrize("path", list(every_command()))
def test_every_flag_megarl_passes_is_one_of_sglangs(flags, path):
    command = every_command()[path]
    assert flag_problems(command, flags) == [], command


def test_prefix_caching_off_is_sglangs_radix_cache_switch(flags):
    """rollout.enable_prefix_caching=false reaches SGLang as its switch `--disable-radix-cache`
    (fields/*.py: disable_radix_cache, a bool field); true, SGLang's default, passes nothing."""
    assert flags["--disable-radix-cache"] == SWITCH
    off = sglang_server_command("/m", 30000, prefix_caching=False)
    assert "--disable-radix-cache" in off and flag_problems(off, flags) == []
    assert "--disable-radix-cache" not in sglang_server_command("/m", 30000)


def test_a_misspelt_or_misused_flag_is_caught(flags):
    """Negative controls: the check fails on a flag SGLang does not define, a value given to a
    switch, and a valued flag without its value."""
    good = sglang_server_command("/m", 30000)
    assert flag_problems(good + ["--enable-deterministic-inferense"], flags) == [
        f"--enable-deterministic-inferense is not a flag of sglang {SGLANG_VERSION}"]
    assert flag_problems(good + ["--enable-memory-saver", "1"], flags) == [
        "--enable-memory-saver is a switch but is given '1'", "'1' is not a flag's value"]
    assert flag_problems(good + ["--nnodes"], flags) == ["--nnodes needs a value"]
    assert flag_problems(good + ["--nnodes", "2", "3"], flags) == ["'3' is not a flag's value"]  # one value only


# ----------------------------------------------------------------------------- endpoints
_ROUTE_METHODS = {"get": {"GET"}, "post": {"POST"}, "put": {"PUT"}, "delete": {"DELETE"}}


def sglang_routes(wheel: Path) -> dict[str, set[str]]:
    """{path: HTTP methods} of the decorated routes of `sglang/srt/entrypoints/http_server.py`."""
    with zipfile.ZipFile(wheel) as z:
        tree = ast.parse(z.read("sglang/srt/entrypoints/http_server.py"))
    routes: dict[str, set[str]] = {}
    for func in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        for deco in func.decorator_list:
            if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
                    and isinstance(deco.func.value, ast.Name) and deco.func.value.id == "app"):
                continue
            path = _constant(deco.args[0]) if deco.args else None
            if not isinstance(path, str):
                continue  # a route named by an environment variable
            if deco.func.attr == "api_route":
                methods = next((k.value for k in deco.keywords if k.arg == "methods"), None)
                found = {_constant(e) for e in methods.elts} if isinstance(methods, ast.List) else {"GET"}
            else:
                found = _ROUTE_METHODS.get(deco.func.attr, set())
            routes.setdefault(path, set()).update(found)
    return routes


CLIENT_SOURCES = ["src/megarl/rollout/control.py", "src/megarl/rollout/client.py", "src/megarl/sync/servers.py",
                  "src/megarl/sync/adapter_sync.py"]


def client_calls() -> list[tuple[str, str, str]]:
    """(file, method or "", path) of every server path megarl's client code names: `_call(METHOD,
    "/path", ...)` calls, `requests.get(url + "/path")`, `url + "/path"` and path defaults."""
    calls = []
    for source in CLIENT_SOURCES:
        tree = ast.parse((REPO / source).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "_call":
                method, path = (_constant(a) for a in node.args[:2])
                calls.append((source, method, path))
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                    node.func.attr in ("get", "post") and node.args and isinstance(node.args[0], ast.BinOp):
                path = _constant(node.args[0].right)
                if isinstance(path, str):
                    calls.append((source, node.func.attr.upper(), path))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    re.fullmatch(r"/[a-z_]+", node.value):
                calls.append((source, "", node.value))
    return calls


def test_every_endpoint_megarl_calls_is_a_route_of_sglang(wheel):
    routes = sglang_routes(wheel)
    assert {"/generate", "/update_weights_from_distributed", "/begin_weight_update"} <= set(routes)
    calls = client_calls()
    assert {p for _, _, p in calls} >= {"/generate", "/health", "/update_weights_from_tensor", "/flush_cache",
                                        "/init_weights_update_group", "/release_memory_occupation",
                                        "/load_lora_adapter_from_tensors"}
    problems = [f"{source}: {method or 'any'} {path}" for source, method, path in calls
                if path not in routes or (method and method not in routes[path])]
    assert problems == [], f"not routes of sglang {SGLANG_VERSION}'s http_server.py: {problems}"


# ----------------------------------------------------------------------------- request structs
REQUIRED = object()  # a field without a default
SGLANG_BASE_REQ = {"rid", "http_worker_ipc"}  # routing fields every request struct has; the CPU server ignores them


def sglang_request_fields(wheel: Path, name: str) -> dict[str, object]:
    """{field: default (the literal), or REQUIRED} of the msgspec struct `name` in
    `sglang/srt/managers/io_struct.py`, with its base `BaseReq`'s fields (rid, http_worker_ipc)."""
    with zipfile.ZipFile(wheel) as z:
        tree = ast.parse(z.read("sglang/srt/managers/io_struct.py"))
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    fields: dict[str, object] = {}
    for cls in (classes["BaseReq"], classes[name]):
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                fields[stmt.target.id] = REQUIRED if stmt.value is None else ast.literal_eval(stmt.value)
    return fields


def test_load_lora_adapter_from_tensors_bodies_have_sglangs_fields(wheel):
    """What adapter-only sync sends and what the CPU server reads are SGLang 0.5.23's
    `LoadLoRAAdapterFromTensorsReqInput`: the body names only its fields and every required one;
    the CPU server's model has exactly its fields (but BaseReq's), the same required ones and defaults."""
    from megarl.rollout.cpu.lora_adapters import LoadLoraAdapterFromTensorsReq
    from megarl.sync.adapter_sync import from_tensors_request

    fields = sglang_request_fields(wheel, "LoadLoRAAdapterFromTensorsReqInput")
    required = {f for f, default in fields.items() if default is REQUIRED}
    assert required == {"lora_name", "config_dict", "serialized_named_tensors"}  # the oracle read the struct
    body = from_tensors_request("v1", {"r": 8}, "payload", tp_size=4)
    assert set(body) <= set(fields) and required <= set(body), sorted(set(body) ^ set(fields))
    assert body["serialized_named_tensors"] == ["payload"] * 4  # one entry per TP rank
    served = LoadLoraAdapterFromTensorsReq.model_fields
    assert set(served) == set(fields) - SGLANG_BASE_REQ
    assert {f for f, info in served.items() if info.is_required()} == required
    assert {f: info.default for f, info in served.items() if not info.is_required()} == {
        f: d for f, d in fields.items() if d is not REQUIRED and f not in SGLANG_BASE_REQ}


def sglang_safe_unpickler(wheel: Path):
    """SGLang 0.5.23's own `SafeUnpickler` (and `_safe_load_torch_storage`, which it maps
    `torch.storage._load_from_bytes` to), taken from `sglang/srt/utils/common.py` and run as is."""
    import io
    import pickle

    import torch

    with zipfile.ZipFile(wheel) as z:
        source = z.read("sglang/srt/utils/common.py").decode()
    wanted = {"SafeUnpickler", "_safe_load_torch_storage"}
    nodes = [n for n in ast.parse(source).body if getattr(n, "name", None) in wanted]
    assert {n.name for n in nodes} == wanted
    namespace = {"io": io, "pickle": pickle, "torch": torch}
    exec(compile(ast.Module(body=nodes, type_ignores=[]), "sglang/srt/utils/common.py", "exec"), namespace)
    return namespace["SafeUnpickler"]


def test_the_adapter_payload_is_by_value_and_sglangs_unpickler_reads_it(wheel):
    """An adapter entry (`serialize_by_value`) is decoded by SGLang's own SafeUnpickler into the
    same tensors, and carries their bytes (no shared-memory or IPC handle: readable on another
    host). Negative controls: SGLang's unpickler refuses a forbidden global, and the
    shared-memory form (`tensor_payload.serialize`, SGLang's ForkingPickler) names a file instead."""
    import base64
    import io
    import os
    import pickle

    import torch

    from megarl.rollout import tensor_payload
    from megarl.sync.adapter_sync import peft_adapter, serialize_by_value

    g = torch.Generator().manual_seed(0)
    buffer = torch.randn(2**16, generator=g)  # megatron's DDP keeps parameters as views into one buffer
    adapters = {"decoder.layers.0.self_attention.linear_qkv_lora.q_proj_A": buffer[:256].view(4, 64),
                "decoder.layers.0.self_attention.linear_qkv_lora.q_proj_B": torch.randn(64, 4, generator=g)}
    config, tensors = peft_adapter(adapters, 4, 8.0, "base")
    assert config["r"] == 4 and config["target_modules"] == ["q_proj"]
    payload = serialize_by_value(tensors)
    raw = base64.b64decode(payload, validate=True)
    safe = sglang_safe_unpickler(wheel)
    decoded = safe(io.BytesIO(raw)).load()
    assert decoded.keys() == tensors.keys()
    assert all(torch.equal(decoded[k], tensors[k]) and decoded[k].dtype == torch.float32 for k in tensors)
    assert len(raw) < 2 * (4 * 64 + 64 * 4) * 4 + 4096  # the tensors' bytes, not the whole buffer's
    assert b"torch.multiprocessing" not in raw and b"rebuild_storage" not in raw

    with pytest.raises(RuntimeError, match="Blocked unsafe global"):
        safe(io.BytesIO(pickle.dumps({"x": os.getcwd}))).load()
    shared = base64.b64decode(tensor_payload.serialize(list(tensors.items())))
    assert b"rebuild_storage_filename" in shared  # same-host only
