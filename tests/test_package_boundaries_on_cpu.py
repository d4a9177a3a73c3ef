"""Static checks on the package (``ast``, nothing imported).

1. Floors (``docs/architecture.md``): every subpackage of ``verl_ds4`` has a floor and imports
   only packages on lower floors (imports inside functions included); ``ds4_facts`` imports
   nothing but the standard library, ``layout`` neither verl nor megatron, and ``testing`` is
   imported by tests and benchmarks only. No import cycle between modules. ``verl_ds4/__init__.py``
   and docs/architecture.md list the same floors.
2. One layout decision: no module except ``verl_ds4/mcore/resolver.py`` decides a CP layout (or
   its padding) from a model name / attention variant. verl 0.9.1 copies such a rule into several
   files; the checker is also run on verl's own engine to show it finds that pattern.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "verl_ds4"
RESOLVER = PACKAGE / "mcore" / "resolver.py"

#: Every subpackage (or top-level module) of verl_ds4 and its floor: it may import only lower floors.
FLOORS = {
    "ds4_facts": 0,
    "ckpt_manifest": 0,
    "layout": 1,
    "ds41_facts": 1,
    "kernels": 1,
    "mcore": 2,
    "substitutes": 1,
    "engine": 3,
    "models": 4,
    "cpu": 5,
    "memory": 5,
    "recipes": 6,
    "verify": 6,
    "rollout": 7,
    "cli": 7,
    "testing": 8,
}
#: Folders that only ship YAML as package data (symlinks to recipes/ and configs/).
DATA_PACKAGES = {"recipes_data", "configs_data"}
FORBIDDEN_THIRD_PARTY = {
    "layout": {"verl", "megatron", "transformer_engine", "vllm"},
    "kernels": {"verl", "megatron", "transformer_engine", "vllm"},
    # the memory model is a function of typed inputs: no config library, no framework (recipes/ reads the config)
    "memory": {"omegaconf", "hydra", "torch", "verl", "megatron", "transformer_engine", "vllm"},
}


def _modules():
    files = sorted(p for p in PACKAGE.rglob("*.py") if not set(p.relative_to(PACKAGE).parts) & DATA_PACKAGES)
    assert RESOLVER in files and len(files) > 5
    return files


def _dotted(path: Path, package: Path = PACKAGE) -> str:
    rel = path.relative_to(package.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path, package_dir: Path = PACKAGE):
    """Absolute names of every import in ``path`` (function-level imports included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    dotted = _dotted(path, package_dir)
    package = dotted if path.name == "__init__.py" else dotted.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:  # `from verl_ds4 import engine` imports a subpackage
                yield node.lineno, f"{module}.{alias.name}"


def _package_of(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] != "verl_ds4" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in FLOORS else None


def floor_violations(files, package_dir: Path = PACKAGE) -> list[str]:
    """``path:line (package, floor) imports name (package, floor)`` for each import that breaks a floor."""
    violations = []
    for path in files:
        own = _package_of(_dotted(path, package_dir))
        if own is None:
            continue
        where = path.relative_to(package_dir.parent)
        seen = set()
        for lineno, name in _imports(path, package_dir):
            target = _package_of(name)
            if (lineno, target) in seen:  # `from a.b import c` also yields a.b.c
                continue
            seen.add((lineno, target))
            if target is not None and target != own and FLOORS[target] >= FLOORS[own]:
                violations.append(f"{where}:{lineno} ({own}, floor {FLOORS[own]}) imports {name} (floor {FLOORS[target]})")
            top = name.split(".")[0]
            if top in FORBIDDEN_THIRD_PARTY.get(own, ()):
                violations.append(f"{where}:{lineno} ({own}) imports {name}")
            if own == "ds4_facts" and top not in sys.stdlib_module_names and top != "__future__":
                violations.append(f"{where}:{lineno} (ds4_facts: standard library only) imports {name}")
            if own == "ds41_facts" and top not in sys.stdlib_module_names and top != "__future__" and target != "ds4_facts":
                violations.append(f"{where}:{lineno} (ds41_facts: standard library and ds4_facts only) imports {name}")
    return violations


def test_every_subpackage_has_a_floor():
    found = {p.name if p.is_dir() else p.stem for p in PACKAGE.iterdir() if not p.name.startswith(("_", "."))}
    found = {name for name in found if name.isidentifier()} - DATA_PACKAGES
    assert found == set(FLOORS), f"give these a floor in FLOORS (and the docs): {sorted(found ^ set(FLOORS))}"


def test_packages_import_only_lower_floors():
    violations = floor_violations(_modules())
    assert not violations, "floors broken:\n" + "\n".join(violations)


def test_floor_checker_sees_imports_inside_functions(tmp_path):
    """Negative control: function-level imports of a higher floor, of verl from layout and of a
    third-party package from ds4_facts are all reported."""
    package = tmp_path / "verl_ds4"
    (package / "layout").mkdir(parents=True)
    (package / "layout" / "plan.py").write_text(
        "def f():\n    from ..engine.megatron import x\n    import verl\n    from verl_ds4 import ds4_facts\n"
    )
    (package / "ds4_facts.py").write_text("import dataclasses\n\ndef g():\n    import torch\n")
    (package / "ds41_facts.py").write_text("from verl_ds4.ds4_facts import Violation\n\ndef h():\n    import numpy\n")
    found = floor_violations(sorted(package.rglob("*.py")), package)
    assert any("imports verl_ds4.engine.megatron (floor 3)" in v for v in found), found
    assert any("(layout) imports verl" in v for v in found), found
    assert any("standard library only) imports torch" in v for v in found), found
    assert any("(ds41_facts: standard library and ds4_facts only) imports numpy" in v for v in found), found
    assert len(found) == 4, found  # the ds4_facts imports from layout and ds41_facts and dataclasses are fine


def test_memory_model_reads_no_config(tmp_path):
    """The memory model is fed typed inputs by recipes/ (a floor above it). Negative control: a memory module that
    reads the Hydra config itself (omegaconf, or recipes' ``_get``) is reported; the real package is clean."""
    assert FLOORS["memory"] < FLOORS["recipes"]
    assert not floor_violations(sorted((PACKAGE / "memory").rglob("*.py")))
    package = tmp_path / "verl_ds4"
    (package / "memory").mkdir(parents=True)
    (package / "memory" / "peak.py").write_text(
        "def f(cfg):\n    from omegaconf import DictConfig\n    from verl_ds4.recipes.roles import _get\n"
    )
    found = floor_violations(sorted(package.rglob("*.py")), package)
    assert any("(memory) imports omegaconf" in v for v in found), found
    assert any("imports verl_ds4.recipes.roles (floor 6)" in v for v in found), found


def _module_graph() -> dict[str, set[str]]:
    modules = {_dotted(p): p for p in _modules()}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for _, imported in _imports(path):
            # `from pkg import name` may name a module or an attribute: take the longest module prefix
            parts = imported.split(".")
            while parts and ".".join(parts) not in modules:
                parts.pop()
            target = ".".join(parts)
            if target and target != name and not name.startswith(target + "."):
                graph[name].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles():
    cycles = find_cycles(_module_graph())
    assert not cycles, "import cycles (function-level imports count):\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_cycle_finder_finds_a_cycle():
    """Negative control for the cycle check."""
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


_FLOOR_LINE = re.compile(r"^\s*(\d+)\.\s+(.*)$")


_FLOOR_ROW = re.compile(r"^\|\s*(\d+)\s*\|(.*)$")  # docs/architecture.md: | floor | `package` | owns | may not |


def _documented_floors(text: str) -> dict[str, int]:
    floors = {}
    for line in text.splitlines():
        match = _FLOOR_LINE.match(line)
        if match is None and (row := _FLOOR_ROW.match(line)):
            floors[row.group(2).split("|")[0].strip().strip("`")] = int(row.group(1))
            continue
        if match:
            for name in re.findall(r"``verl_ds4\.(\w+)``|`verl_ds4\.(\w+)`", match.group(2)):
                floors[name[0] or name[1]] = int(match.group(1))
    return floors


def test_init_and_architecture_doc_list_the_same_floors():
    init_doc = ast.get_docstring(ast.parse((PACKAGE / "__init__.py").read_text()))
    assert _documented_floors(init_doc) == FLOORS
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    assert _documented_floors(architecture) == FLOORS
    # Negative control: a package moved to another floor in the table is noticed.
    moved = architecture.replace("| 5 | `memory` |", "| 4 | `memory` |")
    assert moved != architecture and _documented_floors(moved) != FLOORS


def test_testing_is_imported_by_tests_and_benchmarks_only():
    users = []
    for folder in (ROOT / "scripts", ROOT / "docker", PACKAGE):
        for path in folder.rglob("*.py"):
            if "testing" in path.relative_to(ROOT).parts:
                continue
            users += [f"{path.relative_to(ROOT)}:{n}" for n, name in _imports(path) if name.startswith("verl_ds4.testing")]
    assert not users, users


# ------------------------------------------------------------------ one layout decision

MODEL_MARKERS = {"dsv4_hybrid", "deepseek_v4", "deepseekv4", "deepseek_v3", "dsa"}
MODEL_ATTRIBUTES = {"experimental_attention_variant", "model_type", "architectures"}
LAYOUT_STRINGS = {"contiguous", "zigzag"}
LAYOUT_NAMES = {"min_local_rows", "csa_window_size", "cp_layout", "cp_partition_mode"}


def _mentions_model_identity(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.lower() in MODEL_MARKERS
    if isinstance(node, ast.Attribute):
        return node.attr in MODEL_ATTRIBUTES
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) >= 2:
        arg = node.args[1]
        return isinstance(arg, ast.Constant) and arg.value in MODEL_ATTRIBUTES
    return False


def _scopes(tree: ast.AST):
    """Each function body, and the module / class level outside functions, as node lists."""
    top: list[ast.AST] = []

    def visit(node, sink):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inner: list[ast.AST] = []
                visit(child, inner)
                yield_list.append((getattr(child, "name", "<lambda>"), child.lineno, inner))
            else:
                sink.append(child)
                visit(child, sink)

    yield_list: list = []
    visit(tree, top)
    yield ("<module>", 1, top)
    yield from yield_list


def layout_decisions_from_model_names(source: str, filename: str = "<string>") -> list[str]:
    """Scopes that compare a model name / attention variant and also pick a layout or its padding."""
    found = []
    for name, lineno, nodes in _scopes(ast.parse(source, filename=filename)):
        checks = [
            n
            for n in nodes
            if isinstance(n, ast.Compare) and any(_mentions_model_identity(x) for x in [n.left, *n.comparators])
        ]
        if not checks:
            continue
        picks = [
            n
            for n in nodes
            if (isinstance(n, ast.Constant) and n.value in LAYOUT_STRINGS | LAYOUT_NAMES)
            or (isinstance(n, ast.Attribute) and n.attr in LAYOUT_NAMES)
            or (isinstance(n, ast.Name) and n.id in LAYOUT_NAMES)
            or (isinstance(n, ast.keyword) and n.arg in LAYOUT_NAMES)
        ]
        if picks:
            found.append(f"{filename}:{checks[0].lineno} in {name}()")
    return found


def test_only_the_resolver_decides_a_layout_from_a_model_name():
    violations = []
    for path in _modules():
        if path == RESOLVER:
            continue
        violations += layout_decisions_from_model_names(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert not violations, (
        "these decide a CP layout from a model name; ask verl_ds4.mcore.resolver instead:\n" + "\n".join(violations)
    )


def test_checker_finds_verls_copies_of_the_rule():
    """The checker is not vacuous: it flags verl 0.9.1's copies of the rule."""
    import verl.workers.engine.megatron.transformer_impl as impl

    found = layout_decisions_from_model_names(Path(impl.__file__).read_text(), "transformer_impl.py")
    assert any("_get_context_parallel_layout" in f for f in found), found
    assert any("forward_backward_batch" in f for f in found), found
    assert any("_build_tf_config" in f for f in found), found


@pytest.mark.parametrize(
    "snippet",
    [
        "def f(cfg):\n    return 'contiguous' if cfg.experimental_attention_variant == 'dsv4_hybrid' else 'zigzag'\n",
        "def f(hf, kw):\n    if getattr(hf, 'model_type', None) == 'deepseek_v4':\n        kw['cp_partition_mode'] = 1\n",
        "def f(cfg, pre):\n    rows = cfg.csa_window_size if 'dsv4_hybrid' == cfg.x else None\n    return pre(min_local_rows=rows)\n",
    ],
)
def test_checker_flags_typical_copies_of_the_rule(snippet):
    assert layout_decisions_from_model_names(snippet)


def test_checker_ignores_messages_and_delegation():
    snippet = (
        "def f(resolver, hf):\n"
        "    if resolver.is_ds4_hf_config(hf):\n"
        "        raise ValueError(\"DS4 needs cp_partition_mode='contiguous'\")\n"
    )
    assert not layout_decisions_from_model_names(snippet)


_CITATION = re.compile(r"docs/[\w.-]+\.md")


def missing_citations(root: Path) -> list[str]:
    """``path: docs/x.md`` for each cited ``docs/*.md`` that the repository does not have."""
    missing = []
    for folder in ("verl_ds4", "tests", "benchmarks", "scripts", "configs", "recipes", "docker"):
        for path in sorted((root / folder).rglob("*")):
            if path.name == Path(__file__).name:  # this checker names made-up documents
                continue
            if path.relative_to(root).parts[:3] == ("benchmarks", "gpu", "carry"):  # git-ignored third-party downloads
                continue
            if path.is_file() and path.suffix in (".py", ".sh", ".yaml", ".md", ".sbatch", "") and "__pycache__" not in path.parts:
                text = path.read_text(errors="replace")
                missing += [f"{path.relative_to(root)}: {c}" for c in _CITATION.findall(text) if not (root / c).is_file()]
                if "shared doc" in text:
                    missing.append(f"{path.relative_to(root)}: cites the 'shared doc' (outside the repository)")
    return missing


def test_every_cited_document_is_in_the_repository(tmp_path):
    assert not missing_citations(ROOT)
    # negative control: a citation of a document the tree does not have is found
    (tmp_path / "verl_ds4").mkdir()
    (tmp_path / "verl_ds4" / "m.py").write_text('"""See docs/nowhere.md section 2."""\n')
    assert missing_citations(tmp_path) == ["verl_ds4/m.py: docs/nowhere.md"]
    # the git-ignored carry folder (wheels, an exported megatron/core) is not the repository's text
    (tmp_path / "benchmarks" / "gpu" / "carry" / "megatron_dev").mkdir(parents=True)
    (tmp_path / "benchmarks" / "gpu" / "carry" / "megatron_dev" / "x.py").write_text("# docs/fsdp.md\n")
    assert missing_citations(tmp_path) == ["verl_ds4/m.py: docs/nowhere.md"]
