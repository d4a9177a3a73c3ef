"""Static checks on the package (``ast``, nothing imported).

1. Layering (architecture.md): ``layout`` < ``mcore`` < ``engine`` < ``models`` < ``cli``; each layer
   imports only layers below it, and ``layout`` imports neither verl nor megatron.
2. One layout decision: no module except ``verl_ds4/mcore/resolver.py`` decides a CP layout (or
   its padding) from a model name / attention variant. verl 0.9.1 copies such a rule into several
   files; the checker is also run on verl's own engine to show it finds that pattern.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "verl_ds4"
RESOLVER = PACKAGE / "mcore" / "resolver.py"

LAYERS = ["layout", "mcore", "engine", "models", "cli"]
FORBIDDEN_THIRD_PARTY = {"layout": {"verl", "megatron", "transformer_engine", "vllm"}}


def _modules():
    files = sorted(PACKAGE.rglob("*.py"))
    assert RESOLVER in files and len(files) > 5
    return files


def _dotted(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _imports(path: Path):
    """Absolute names of every import in ``path`` (function-level imports included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _dotted(path) if path.name == "__init__.py" else _dotted(path).rsplit(".", 1)[0]
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


def _layer(name: str) -> str | None:
    parts = name.split(".")
    if parts[0] != "verl_ds4" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in LAYERS else None


def test_layers_import_only_layers_below():
    violations = []
    for path in _modules():
        own = _layer(_dotted(path))
        if own is None:
            continue
        allowed = set(LAYERS[: LAYERS.index(own) + 1])
        for lineno, name in _imports(path):
            target = _layer(name)
            if target is not None and target not in allowed:
                violations.append(f"{path.relative_to(PACKAGE.parent)}:{lineno} ({own}) imports {name} ({target})")
            top = name.split(".")[0]
            if top in FORBIDDEN_THIRD_PARTY.get(own, ()):
                violations.append(f"{path.relative_to(PACKAGE.parent)}:{lineno} ({own}) imports {name}")
    assert not violations, "layering broken:\n" + "\n".join(violations)


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
