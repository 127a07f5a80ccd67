"""The package's shape, held by tests: imports run one way with no cycle, only the HF adapter reaches into
transformers, files stay small, and a step runs code in few files (docs/architecture.md, "Layout")."""

from __future__ import annotations

import ast
import os
import sys
import threading
from pathlib import Path

import torch

import hfaccel
from hfaccel.config import EngineConfig
from hfaccel.engine.engine import Engine
from hfaccel.engine.request import StoppingParams
from tests.helpers import tiny_model

PACKAGE = Path(hfaccel.__file__).parent
# Lower layers first: a module may import its own layer and the layers before it, never a later one.
LAYERS = [
    ("kernels", "distributed", "default_model"),
    ("config",),
    ("engine",),
    ("patches",),
    ("api",),
    ("server",),
    ("notebook", "doctor", "bench", "cli", "cli_bench", "cli_loading", "cli_types", "__init__", "__main__"),
]
MAX_LINES = 600
# 14 until every step read the model's sentinel (engine/model_watch.py, patches/model_state.py: a change
# made and undone between admissions left stale KV in the prefix cache).
# 16 until the eager step ran the layer loop itself (patches/layer_loop.py), not transformers' top-level
# forward and its wrappers: one file of ours for a dozen functions of theirs a step.
# 17 until Llama's layers ran written out (patches/direct_layers.py), not through nn.Module's call and
# transformers' deprecation wrappers: the same again, a layer deeper.
MAX_DECODE_STEP_FILES = 18
# 22 until the loop's caller side (engine/submission.py) left loop.py: same code; 25 until direct_layers.py.
MAX_WARM_GENERATE_FILES = 26


def modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules `name` imports, anywhere in the file (type-checking imports included)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            targets |= {base} | {f"{base}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
    return {t for t in targets if t in known and t != name and not name.startswith(t + ".")}


def layer_of(name: str) -> int:
    top = name.split(".")[1] if "." in name else "__init__"
    return next(i for i, names in enumerate(LAYERS) if top in names)


def test_imports_run_one_way_and_form_no_cycle():
    known = modules()
    graph = {name: imports_of(name, path, known) for name, path in known.items()}
    upward = sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        for target in targets
        if layer_of(target) > layer_of(name)
    )
    assert upward == [], "imports that run back up the layers"
    # Tarjan's strongly connected components: any of more than one module is an import cycle.
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert cycles == []


def test_only_the_hf_adapter_imports_transformers_internals():
    """The engine, kernels and parallel runtime import nothing of transformers; the layers above the
    adapter use its public top-level names only."""
    offenders = []
    for name, path in modules().items():
        top = name.split(".")[1] if "." in name else "__init__"
        if top == "patches":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [module or ""]
            for imported in names:
                if imported != "transformers" and not imported.startswith("transformers."):
                    continue
                private = isinstance(node, ast.ImportFrom) and any(a.name.startswith("_") for a in node.names)
                if top in ("kernels", "engine", "distributed", "config") or private:
                    offenders.append(f"{name}: {imported}")
    assert offenders == []


def test_no_file_is_over_600_lines():
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def files_run(call) -> list[str]:
    """The package's files whose code runs during `call()`, in every thread (the profiler hook is set
    before the call and seen by threads started earlier through `hooked`)."""
    seen: set[str] = set()
    root = str(PACKAGE)

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            seen.add(os.path.relpath(frame.f_code.co_filename, root))

    hooked.append(hook)
    sys.setprofile(_dispatch)
    try:
        call()
    finally:
        sys.setprofile(None)
        hooked.remove(hook)
    return sorted(seen)


hooked: list = []


def _dispatch(frame, event, arg):
    for hook in hooked:
        hook(frame, event, arg)


def test_a_decode_step_with_features_off_runs_code_in_few_files():
    engine = Engine(tiny_model("llama"), EngineConfig(kv_cache_memory=4_000_000))
    for _ in range(2):
        engine.add_request([5, 6, 7, 8], StoppingParams(max_new_tokens=50))
    engine.step()
    engine.step()  # both decode from here
    files = files_run(engine.step)
    assert len(files) <= MAX_DECODE_STEP_FILES, files


def test_a_warm_generate_runs_code_in_few_files_in_both_threads():
    threading.setprofile(_dispatch)  # the loop thread starts at the first generate and keeps the hook
    try:
        model = hfaccel.patch(tiny_model("llama"), kv_cache_memory=4_000_000)
        ids = torch.tensor([[5, 6, 7, 8]])
        model.generate(ids, max_new_tokens=4, do_sample=False)
        files = files_run(lambda: model.generate(ids, max_new_tokens=4, do_sample=False))
    finally:
        threading.setprofile(None)
        hfaccel.unpatch(model)
    assert any(f.startswith("kernels/") for f in files), "the loop thread's step was not seen"
    assert len(files) <= MAX_WARM_GENERATE_FILES, files
