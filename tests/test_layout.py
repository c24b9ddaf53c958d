"""The layout says the layers: rooms import one way (cli -> serve, bench, batch -> engine -> workers -> scheduler,
kernels), no module sits in an import circle, and no room holds more than a quarter of the shipped lines."""

import ast
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
# A room may import the rooms of a lower rank only; rooms of one rank do not import each other.
RANKS = {
    "kernels": 0,
    "scheduler": 0,
    "workers": 1,
    "engine": 2,
    "serve": 3,
    "bench": 3,
    "batch": 3,
    "raylm": 3,
    "cli": 4,
}
# What the workers take from the scheduler: its data classes, which the scheduler defines for both sides.
DATA_CLASSES = {"scheduler", "scheduler.outputs", "scheduler.request", "scheduler.sampling_params"}
MAX_ROOM_SHARE = 0.25


def shipped_rooms() -> list[str]:
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    return [pattern.removesuffix("*") for pattern in include["include"]]


def shipped_modules() -> dict[str, Path]:
    return {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
        for room in shipped_rooms()
        for p in (ROOT / room).rglob("*.py")
    }


def imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that `path` imports anywhere in it (a function's imports count too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            found.add(name)
    return found - {""}


def import_graph() -> dict[str, set[str]]:
    modules = shipped_modules()
    return {name: imports(path, set(modules)) - {name} for name, path in modules.items()}


def test_every_room_has_a_rank():
    assert set(shipped_rooms()) == set(RANKS)


def test_rooms_import_only_the_rooms_below_them():
    wrong = []
    for module, imported in import_graph().items():
        room = module.split(".")[0]
        for target in imported:
            other = target.split(".")[0]
            if other == room or (room == "workers" and target in DATA_CLASSES):
                continue
            if RANKS[other] >= RANKS[room]:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports up or sideways between rooms:\n" + "\n".join(sorted(wrong))


def test_no_module_is_in_an_import_circle():
    """A circle would have to be held off by imports hidden in functions, and says two modules are one job."""
    graph = import_graph()
    circles = []
    for start in graph:
        seen, frontier = set(), set(graph[start])
        while frontier:
            name = frontier.pop()
            if name == start:
                circles.append(start)
                break
            if name not in seen:
                seen.add(name)
                frontier |= graph[name]
    assert not circles, f"modules that import themselves through others: {sorted(circles)}"


def test_no_room_holds_more_than_a_quarter_of_the_shipped_lines():
    lines = dict.fromkeys(shipped_rooms(), 0)
    for module, path in shipped_modules().items():
        if not path.name.endswith("_pb2.py") and not path.name.endswith("_pb2_grpc.py"):
            lines[module.split(".")[0]] += len(path.read_text().splitlines())
    total = sum(lines.values())
    big = {room: f"{n / total:.0%}" for room, n in lines.items() if n > MAX_ROOM_SHARE * total}
    assert not big, f"rooms over {MAX_ROOM_SHARE:.0%} of {total} shipped lines: {big}"


# The engine modules serve may import. The client (what a replica talks to its engine through) and the settings,
# and three that hold no engine state: model_files, what a model directory says as the settings select it (the
# tokenizer, generation defaults, pooling), read where no engine runs too (the request router's deployment);
# connect and placement, the launch work of serve/app.py's driver, which starts Ray with room for every replica and
# sizes each deployment's placement group with the engine's bundles before any engine exists (Serve, not the
# engine, reserves a replica's group); network, this host's free ports for Serve's proxies; and output, the one
# output path (text and stop strings from a request's deltas) that the offline LLM and the server share.
SERVE_ENGINE_MODULES = {
    "engine.client",
    "engine.config",
    "engine.model_files",
    "engine.connect",
    "engine.placement",
    "engine.network",
    "engine.output",
}
# What serve takes from the scheduler: the request going in, its deltas and errors coming out, its sampling
# settings and the engine's stats, all exported by the scheduler package; never the scheduler's own state
# (scheduler.request.Request, block hashes), which the engine computes for it (engine.client).
SERVE_SCHEDULER_NAMES = {
    "EngineRequest",
    "KVTransferError",
    "RequestError",
    "RequestOutput",
    "SampledLogprobs",
    "SamplingParams",
    "SchedulerStats",
    "StructuredOutputsParams",
    "merge_deltas",
}


def test_serve_reaches_the_engine_through_its_client_only():
    """serve talks to one EngineClient (engine/client.py), never to an engine's parts or the scheduler's state:
    the engine modules it imports are SERVE_ENGINE_MODULES, and from the scheduler only SERVE_SCHEDULER_NAMES,
    through the package."""
    modules = shipped_modules()
    wrong = []
    for module, path in modules.items():
        if module.split(".")[0] != "serve":
            continue
        for target in imports(path, set(modules)):
            if target.startswith(("engine.", "workers.", "kernels.")) and target not in SERVE_ENGINE_MODULES:
                wrong.append(f"{module} -> {target}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "scheduler":
                names = {a.name for a in node.names}
                if node.module != "scheduler" or names - SERVE_SCHEDULER_NAMES:
                    wrong.append(f"{module} -> {node.module}: {sorted(names)}")
            elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "scheduler" for a in node.names):
                wrong.append(f"{module} -> {[a.name for a in node.names]}")
    assert not wrong, "serve reaching past the engine's client:\n" + "\n".join(sorted(wrong))
