"""The packages of src/megarl import only downwards, as docs/architecture.md ("Layers") lays them
out: every `megarl.X` import of every module (inside functions too) is checked against the layers
below. No module imports itself through others (no import cycle between modules, within a package
too). The CPU stand-ins (`rollout.cpu`, `engines.megatron.cpu`) are entered only where stated.
tools/ sits above them all: a tool may import any package of megarl and other tools, and
nothing in src/ or tests/ imports a tool (tests run tools as scripts)."""
import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "megarl"

# From the top (docs/architecture.md, "Layers", states these and the reasons). The first plan was
# cli -> trainer -> workers -> engines, sync, placement, data -> bridge, rollout, algos, rewards,
# config, checkpoint, tracking. Placed here beyond that line:
#   demo      the quickstart command, beside cli
#   launch    starts Ray clusters and runs the experiment as a subprocess (`megarl submit`,
#             `check-cluster`); its cluster check places probe workers like the trainer does
#   runtime   what the loops drive (cluster, rollout fleet, role handles, devices), apart from the
#             loops in trainer; above workers, whose Ray actors it places and calls
#   agents    multi-turn episodes against the rollout servers, for the trainer; built on data's
#             prompts and batches, so above data
#   config    the floor: every package reads the config, and it imports nothing of megarl
#   net       free ports, for every package that opens one
#   megarl    the package's own __init__ (`megarl.__version__`)
#   testing   the harness of gloo worlds for tests and benchmarks, on top: nothing in src imports it
#   experimental  verl's verl.experimental entry points under megarl's name, beside cli
#   recipe    verl-recipe's entry points under megarl's name, beside cli
LAYERS = [
    {"cli", "demo", "testing", "experimental", "recipe"},
    {"trainer", "launch"},
    {"runtime"},
    {"workers", "agents"},
    {"engines", "sync", "placement", "data"},
    {"bridge", "rollout", "algos", "rewards", "checkpoint", "tracking"},
    {"config", "net", "megarl"},
]

# Imports within one layer that the code needs today, each with the reason it stays.
ALLOWED_WITHIN_LAYER = {
    # The engines run on data's batch containers, sequence packing and micro-batch partition
    # (§2 gives these to data): engines sit above data in fact.
    ("engines", "data"),
    # The actor engine's HF export (`ActorEngine.export_hf`) streams its weights through the
    # resharder (megarl.sync.export), the same path as the weight push: engines sit above sync.
    ("engines", "sync"),
    # `megarl export` (checkpoint.export_hf) converts a checkpoint's torch_dist actor with the
    # bridge's converter; nothing below imports checkpoint, so it sits above bridge in fact.
    ("checkpoint", "bridge"),
}

LAYER_OF = {package: depth for depth, layer in enumerate(LAYERS) for package in layer}


def package_of_file(path: Path, src: Path) -> str:
    """The top-level package of a module under `src` (a top-level module is its own)."""
    parts = path.relative_to(src).parts
    if parts == ("__init__.py",):
        return "megarl"
    return parts[0].removesuffix(".py")


def imported_modules(path: Path, src: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, in line order, relative ones
    resolved; for `from megarl import x`, the module `megarl.x`."""
    tree = ast.parse(path.read_text(), str(path))
    package = ["megarl", *path.relative_to(src).parent.parts]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + (node.module.split(".") if node.module else []))
            if module == "megarl":
                found += [(node.lineno, f"megarl.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, module))
    return sorted(found)


def package_of_module(module: str) -> str | None:
    """`megarl.X...` -> X (`megarl` itself -> "megarl"); None outside megarl."""
    parts = module.split(".")
    if parts[0] != "megarl":
        return None
    return parts[1] if len(parts) > 1 else "megarl"


def megarl_imports(src: Path = SRC) -> list[tuple[str, int, str, str, str]]:
    """(file, line, module, importing package, imported package) of every import between packages."""
    edges = []
    for path in sorted(src.rglob("*.py")):
        source = package_of_file(path, src)
        for line, module in imported_modules(path, src):
            target = package_of_module(module)
            if target is not None and target != source:
                edges.append((str(path.relative_to(src.parent)), line, module, source, target))
    return edges


def violations(edges) -> list[str]:
    """One line per import that does not point down (nor is allowed within its layer)."""
    wrong = []
    for file, line, module, source, target in edges:
        if target not in LAYER_OF:
            wrong.append(f"{file}:{line} imports {module}: no such package")
        elif LAYER_OF[target] < LAYER_OF[source]:
            wrong.append(f"{file}:{line} imports {module}: {target} is above {source}")
        elif LAYER_OF[target] == LAYER_OF[source] and (source, target) not in ALLOWED_WITHIN_LAYER:
            wrong.append(f"{file}:{line} imports {module}: {target} is in {source}'s own layer")
    return wrong


def test_every_package_has_a_layer():
    packages = {package_of_file(p, SRC) for p in SRC.rglob("*.py")}
    assert packages - LAYER_OF.keys() == set(), "place new packages in LAYERS"


def test_imports_point_down_only():
    wrong = violations(megarl_imports())
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_every_allowed_exception_is_still_needed():
    used = {(source, target) for *_, source, target in megarl_imports()}
    assert ALLOWED_WITHIN_LAYER - used == set()


def test_the_check_sees_imports_inside_functions_and_relative_ones(tmp_path):
    fake = tmp_path / "megarl"
    (fake / "rollout").mkdir(parents=True)
    module = fake / "rollout" / "client.py"
    module.write_text("import os\n\ndef f():\n    from megarl.trainer import rl\n\n"
                      "from .. import workers\nfrom . import process\nimport megarl\nfrom megarl.bridge import x\n")
    assert imported_modules(module, fake) == [(1, "os"), (4, "megarl.trainer"), (6, "megarl.workers"),
                                              (7, "megarl.rollout"), (8, "megarl"), (9, "megarl.bridge")]
    assert violations(megarl_imports(fake)) == [
        "megarl/rollout/client.py:4 imports megarl.trainer: trainer is above rollout",
        "megarl/rollout/client.py:6 imports megarl.workers: workers is above rollout",
        "megarl/rollout/client.py:9 imports megarl.bridge: bridge is in rollout's own layer",
    ]


# ---------------------------------------------------------------------------------------- cycles
def module_name(path: Path, src: Path) -> str:
    """The dotted name of a module under `src` (a package's `__init__.py` is the package)."""
    parts = [src.name, *path.relative_to(src).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph(src: Path = SRC) -> dict[str, set[str]]:
    """{module: the megarl modules it imports}, from every import (inside functions too, relative
    ones resolved); `from megarl.a import b` imports the module `megarl.a.b` where there is one,
    else `megarl.a`."""
    paths = {module_name(path, src): path for path in sorted(src.rglob("*.py"))}
    graph = {}
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                module = ".".join(base + (node.module.split(".") if node.module else []))
                found |= {f"{module}.{a.name}" if f"{module}.{a.name}" in paths else module for a in node.names}
        graph[name] = (found & paths.keys()) - {name}
    return graph


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of imports, its first module repeated at its end ([] when there is none)."""
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        return list(reversed(error.args[1]))  # graphlib lists it against the import direction
    return []


def test_no_module_imports_itself_through_others():
    cycle = import_cycle(module_graph())
    assert not cycle, "modules that import each other: " + " -> ".join(cycle)


def test_the_cycle_check_sees_imports_inside_functions_and_of_submodules(tmp_path):
    fake = tmp_path / "megarl"
    (fake / "bridge").mkdir(parents=True)
    (fake / "bridge" / "__init__.py").write_text("from megarl.bridge.errors import ConversionError\n")
    (fake / "bridge" / "errors.py").write_text("class ConversionError(Exception): pass\n")
    (fake / "bridge" / "convert.py").write_text("from megarl.bridge import errors, lora\n")
    (fake / "bridge" / "lora.py").write_text("def write():\n    from .convert import atomic_output_dir\n")
    assert module_graph(fake) == {
        "megarl.bridge": {"megarl.bridge.errors"},
        "megarl.bridge.errors": set(),
        "megarl.bridge.convert": {"megarl.bridge.errors", "megarl.bridge.lora"},
        "megarl.bridge.lora": {"megarl.bridge.convert"},
    }
    assert import_cycle(module_graph(fake)) in (
        ["megarl.bridge.convert", "megarl.bridge.lora", "megarl.bridge.convert"],
        ["megarl.bridge.lora", "megarl.bridge.convert", "megarl.bridge.lora"],
    )
    (fake / "bridge" / "lora.py").write_text("from megarl.bridge.errors import ConversionError\n")
    assert import_cycle(module_graph(fake)) == []


# ------------------------------------------------------------------------------------ stand-ins
# The CPU stand-ins, each a subpackage of the part it stands in for, and the only modules outside it
# that import it (docs/architecture.md, "Layers"). A GPU run never executes them.
STAND_INS = {
    # megarl's CPU engine, the stand-in for an SGLang server: started as a command
    # (`rollout.launch.cpu_server_command`), never imported by the product.
    "megarl.rollout.cpu": set(),
    # megatron-core's shims for a CPU-only torch over gloo.
    "megarl.engines.megatron.cpu": {
        "megarl.engines.megatron.parallel",  # applies them when CUDA is absent (`init_role_parallel_state`)
        "megarl.engines.megatron.model",  # names the installed megatron-core in an error (`megatron_core_version`)
        "megarl.launch.doctor",  # reports the releases the shims were verified on
        "megarl.testing",  # the gloo worlds of the tests apply them (`init_gloo_model_parallel`)
    },
}


def stand_in_of(module: str) -> str | None:
    """The stand-in package `module` belongs to, or None."""
    return next((s for s in STAND_INS if module == s or module.startswith(s + ".")), None)


def stand_in_entries(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(stand-in, module outside it) for every module that imports a stand-in."""
    return {(stand_in_of(t), m) for m, imported in graph.items() for t in imported
            if stand_in_of(t) is not None and stand_in_of(t) != stand_in_of(m)}


def test_the_stand_ins_are_entered_only_where_stated():
    wrong = sorted(f"{m} imports {s}" for s, m in stand_in_entries(module_graph()) if m not in STAND_INS[s])
    assert not wrong, "imports of a CPU stand-in from outside it (state them in STAND_INS):\n" + "\n".join(wrong)


def test_every_stated_entry_is_still_needed():
    stated = {(s, m) for s, importers in STAND_INS.items() for m in importers}
    assert stated - stand_in_entries(module_graph()) == set()


def test_the_stand_in_check_sees_an_import_from_outside(tmp_path):
    fake = tmp_path / "megarl"
    (fake / "rollout" / "cpu").mkdir(parents=True)
    (fake / "rollout" / "cpu" / "engine.py").write_text("import torch\n")
    (fake / "rollout" / "cpu" / "server.py").write_text("from megarl.rollout.cpu.engine import CPUEngine\n")
    (fake / "rollout" / "client.py").write_text("def f():\n    from megarl.rollout.cpu import engine\n")
    assert stand_in_entries(module_graph(fake)) == {("megarl.rollout.cpu", "megarl.rollout.client")}


# ---------------------------------------------------------------------------------------- tools/
def tool_names(tools: Path) -> set[str]:
    """The module names tools are imported by: each script runs with its own folder on sys.path, so a
    tool imports another as `bench_common` or `gpu_check`; and the folder's own name."""
    return {path.stem for path in tools.rglob("*.py")} | {tools.name}


def tool_violations(tools: Path, src: Path, tests: Path) -> list[str]:
    """One line per import against tools/' place on top: a tool importing tests or a megarl package
    that does not exist; a module of src/ or tests/ importing a tool."""
    wrong = []
    for path in sorted(tools.rglob("*.py")):
        for line, module in imported_modules(path, tools):
            where = f"{path.relative_to(tools.parent)}:{line} imports {module}"
            if module.split(".")[0] == tests.name:
                wrong.append(f"{where}: tools never import tests")
            elif package_of_module(module) not in (None, *LAYER_OF):
                wrong.append(f"{where}: no such package")
    names = tool_names(tools)
    for root in (src, tests):
        for path in sorted(root.rglob("*.py")):
            for line, module in imported_modules(path, root):
                if module.split(".")[0] in names:
                    wrong.append(f"{path.relative_to(root.parent)}:{line} imports {module}: nothing imports a tool "
                                 "(run it as a script)")
    return wrong


def test_tools_sit_on_top():
    wrong = tool_violations(ROOT / "tools", SRC, ROOT / "tests")
    assert not wrong, "imports against tools/' place:\n" + "\n".join(wrong)


def test_the_tools_check_sees_each_wrong_direction(tmp_path):
    tools, src, tests = tmp_path / "tools", tmp_path / "src" / "megarl", tmp_path / "tests"
    for folder in (tools / "bench", src / "trainer", tests / "trainer"):
        folder.mkdir(parents=True)
    (tools / "bench" / "bench_common.py").write_text("import json\n")
    (tools / "bench" / "grpo.py").write_text("import bench_common\nfrom megarl.trainer import rl\n"
                                             "from megarl.nowhere import x\nfrom tests.trainer import helpers\n")
    (src / "trainer" / "rl.py").write_text("import os\n\ndef f():\n    import bench_common\n")
    (tests / "trainer" / "test_rl.py").write_text("from tools.bench import grpo\nimport megarl\n")
    assert tool_violations(tools, src, tests) == [
        "tools/bench/grpo.py:3 imports megarl.nowhere: no such package",
        "tools/bench/grpo.py:4 imports tests.trainer: tools never import tests",
        "megarl/trainer/rl.py:4 imports bench_common: nothing imports a tool (run it as a script)",
        "tests/trainer/test_rl.py:1 imports tools.bench: nothing imports a tool (run it as a script)",
    ]

