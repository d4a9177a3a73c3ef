"""The error catalogue check: every user-facing refusal in the code is on ``docs/troubleshooting.md``, and
every message on that page is still raised somewhere.

A *raising site* is one place in the code that stops a run with a message for the user:

* Python (the modules of :data:`SCOPE`): ``raise SomeError(<message>)``, ``Problem(<setting>, <message>,
  <fix>)`` (a recipe-validation finding, printed as ``<setting>: <message> Fix: <fix>``) and the memory
  model's ``Finding(<setting>, <message>, <fix>)`` (which the recipe layer passes on as a ``Problem``),
  ``parser.error(<message>)``, ``sys.exit(<message>)``, and a CLI's ``print(<message>, file=sys.stderr)``
  followed by a non-zero ``return`` / ``sys.exit``;
* shell (the launchers of :data:`SHELL_SCOPE`): ``ds4_die "<message>"`` and ``echo "<message>" >&2``
  followed by ``exit 1`` / ``exit 2``.

Each site's message becomes a pattern: its literal text, with every interpolated part (``{value}`` of an
f-string, ``$VAR`` / ``$(...)`` in shell, a ``.format`` field, a variable) as a wildcard. A message built in
a variable is followed to the variable's assignments in the same function. A site whose literal text is
too short to recognise (under :data:`MIN_LITERAL` characters), an internal invariant rather than a
user-facing error, or one that passes on a message catalogued where it is built, carries an
``# error-catalogue: <why it is not listed>`` comment on its line (shell too) and is left out.
``ds4_facts.Violation(key, value, reason, fix)`` (and V4.1's) is a site where it is built, as
``key ... reason ... fix``, which matches both of its renderings (``key=value: reason. fix`` from an
engine, ``<block>.key: is value, but reason. Fix: fix`` from the recipe validator); the places that
raise or print a violation, and ``raise RecipeValidationError([...])`` around ``Problem`` sites, add
nothing.

The page's catalogue is every fenced block whose info string is ``error``: each non-empty line there
is a message as a user sees it (values filled in, or shown as ``<name>``). The check is both ways:

* every site's pattern matches somewhere in the catalogue (a new refusal must be documented);
* every catalogue line is covered by a match of some site's pattern (a documented refusal that the
  code no longer raises fails).

``python -m verl_ds4.testing.error_catalogue`` prints the sites that are missing from the page, each as
a line ready to paste (interpolations as ``<...>``), and the catalogue lines no site covers.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "troubleshooting.md"

# The modules whose refusals a user meets at start-up or on a bad input row: recipe validation and its
# checks (memory, checkpoint, resume), the model facts, the CP layout resolver and its protocol, the
# engine plugin and the CPU model builders, the data rows, the RL start-up checks and the CLIs.
SCOPE = (
    "verl_ds4/recipes/validate.py",
    "verl_ds4/recipes/roles.py",
    "verl_ds4/memory/stages.py",
    "verl_ds4/memory/roles.py",
    "verl_ds4/memory/fixes.py",
    "verl_ds4/memory/host.py",
    "verl_ds4/memory/rollout.py",
    "verl_ds4/recipes/memory_inputs.py",
    "verl_ds4/recipes/memory_check.py",
    "verl_ds4/recipes/kernel_check.py",
    "verl_ds4/memory/micro_batches.py",
    "verl_ds4/memory/kernels.py",
    "verl_ds4/memory/peak.py",
    "verl_ds4/recipes/checkpoint_check.py",
    "verl_ds4/recipes/compose.py",
    "verl_ds4/recipes/seq_len.py",
    "verl_ds4/recipes/seq_cp.py",
    "verl_ds4/recipes/resume_check.py",
    "verl_ds4/recipes/ckpt_resume.py",
    "verl_ds4/recipes/supervise.py",
    "verl_ds4/recipes/shared_folder.py",
    "verl_ds4/engine/checkpoint.py",
    "verl_ds4/recipes/command.py",
    "verl_ds4/recipes/override_keys.py",
    "verl_ds4/recipes/plan_command.py",
    "verl_ds4/memory/fit.py",
    "verl_ds4/ds4_facts.py",
    "verl_ds4/ds41_facts.py",
    "verl_ds4/mcore/resolver.py",
    "verl_ds4/mcore/requirements.py",
    "verl_ds4/mcore/indexer_replay.py",
    "verl_ds4/mcore/sparse_attention_patch.py",
    "verl_ds4/engine/plugin.py",
    "verl_ds4/engine/config.py",
    "verl_ds4/cpu/ds4_builder.py",
    "verl_ds4/cpu/ds41_builder.py",
    "verl_ds4/cpu/platform.py",
    "verl_ds4/models/ds4/sft_dataset.py",
    "verl_ds4/models/ds4/rl_dataset.py",
    "verl_ds4/models/ds4/chat.py",
    "verl_ds4/models/ds4/hf_checkpoint.py",
    "verl_ds4/models/ds4/attention.py",
    "verl_ds4/models/ds4/checkpoint_format.py",
    "verl_ds4/models/ds4/hf_dequant.py",
    "verl_ds4/models/ds41/folder.py",
    "verl_ds4/models/ds41/released.py",
    "verl_ds4/rollout/mismatch_gate.py",
    "verl_ds4/rollout/cpu.py",
    "verl_ds4/rollout/agent_loop.py",
    "verl_ds4/cli.py",
    "verl_ds4/verify/cli.py",
    "verl_ds4/verify/production.py",
    "verl_ds4/verify/production_cli.py",
    "verl_ds4/substitutes/megatron_dev.py",
    "verl_ds4/substitutes/imports.py",
    "verl_ds4/substitutes/environment.py",
    "verl_ds4/cpu/production_engine.py",
    "verl_ds4/cpu/engine.py",
    "verl_ds4/verify/ds41_hf.py",
    "verl_ds4/verify/seqlen.py",
    "verl_ds4/layout/plan_cli.py",
    "verl_ds4/engine/doctor_cli.py",
    "verl_ds4/engine/ckpt_doctor.py",
)
SHELL_SCOPE = (
    "scripts/cluster_lib.sh",
    "scripts/ray_cluster.sh",
    "scripts/slurm_submit.sh",
    "scripts/slurm_sft.sbatch",
    "scripts/slurm_ray_rl.sbatch",
    "scripts/run_ds4_proxy_sft_cpu.sh",
    "scripts/run_ds4_proxy_ppo_cpu.sh",
    "scripts/run_deepseek_v4_flash_sft_megatron.sh",
    "scripts/run_deepseek_v4_flash_ppo_megatron.sh",
    "scripts/run_deepseek_v4_flash_grpo_megatron.sh",
)
MIN_LITERAL = 12
NOT_USER_FACING = "# error-catalogue:"
WILD = "\x00"  # an interpolated part, while a message is being assembled


@dataclass(frozen=True)
class Site:
    path: str
    line: int
    parts: tuple[str, ...]  # literal text, with WILD where something is interpolated

    @property
    def literal(self) -> str:
        return "".join(p for p in self.parts if p != WILD)

    @property
    def pattern(self) -> re.Pattern:
        """The literal text in order with anything on the same line between (a message's own newlines are
        literal text); a leading interpolation is dropped (the search finds the text wherever it starts) and a
        trailing one runs to the end of its line."""
        parts = list(self.parts)
        while parts and parts[0] == WILD:
            parts.pop(0)
        tail = ""
        while parts and parts[-1] == WILD:
            parts.pop()
            tail = r"[^\n]*"
        return re.compile("".join(r"[^\n]*?" if p == WILD else re.escape(p) for p in parts) + tail)

    def example(self) -> str:
        """The message with ``<...>`` for each interpolated part: a line to paste into the page."""
        return "".join("<...>" if p == WILD else p for p in self.parts).replace("\n", " ")

    def where(self) -> str:
        return f"{self.path}:{self.line}"


# ------------------------------------------------------------------------------------------ Python


def _merge(parts: list[str]) -> tuple[str, ...]:
    out: list[str] = []
    for p in parts:
        if p == "":
            continue
        if p == WILD and out and out[-1] == WILD:
            continue
        if p != WILD and out and out[-1] != WILD:
            out[-1] += p
        else:
            out.append(p)
    return tuple(out)


class _Messages:
    """Turns a message expression into parts, following names to their assignments in the function."""

    def __init__(self, function: ast.AST | None):
        self.assignments: dict[str, list[ast.expr]] = {}
        for node in ast.walk(function) if function is not None else ():
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        self.assignments.setdefault(target.id, []).append(node.value)
            elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name):
                self.assignments.setdefault(node.target.id, []).append(
                    ast.BinOp(ast.Name(node.target.id), ast.Add(), node.value))

    def parts(self, node: ast.expr | None, depth: int = 0) -> list[str]:
        if node is None or depth > 6:
            return [WILD]
        if isinstance(node, ast.Constant):
            return [node.value] if isinstance(node.value, str) else [WILD]
        if isinstance(node, ast.JoinedStr):
            out: list[str] = []
            for value in node.values:
                out += [value.value] if isinstance(value, ast.Constant) else [WILD]
            return out
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            return self.parts(node.left, depth + 1) + self.parts(node.right, depth + 1)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Constant):
            return [WILD if i % 2 else s for i, s in enumerate(re.split(r"%[-#0 +]*\d*(?:\.\d+)?[sdrfgx]", node.left.value))]
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format"
                and isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str)):
            return [WILD if i % 2 else s for i, s in enumerate(re.split(r"\{[^{}]*\}", node.func.value.value))]
        if isinstance(node, ast.Name) and node.id in self.assignments and len(self.assignments[node.id]) == 1:
            return self.parts(self.assignments[node.id][0], depth + 1)
        return [WILD]


def _functions(tree: ast.AST):
    """(node, enclosing function) for every node."""
    stack: list[tuple[ast.AST, ast.AST | None]] = [(tree, None)]
    while stack:
        node, function = stack.pop()
        yield node, function
        inner = node if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
        stack.extend((child, inner) for child in ast.iter_child_nodes(node))


def _call_name(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _is_stderr_print(statement: ast.stmt) -> bool:
    call = statement.value if isinstance(statement, ast.Expr) else None
    return (isinstance(call, ast.Call) and _call_name(call) == "print" and len(call.args) == 1
            and any(k.arg == "file" and ast.unparse(k.value) == "sys.stderr" for k in call.keywords))


def _is_failure_exit(statement: ast.stmt) -> bool:
    """``return 1`` / ``return 2`` / ``sys.exit(2)`` / ``raise SystemExit(2)``: a CLI's refusal after its message."""
    value = None
    if isinstance(statement, ast.Return):
        value = statement.value
    elif isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call) and ast.unparse(statement.value.func) == "sys.exit":
        value = statement.value.args[0] if statement.value.args else None
    elif isinstance(statement, ast.Raise) and isinstance(statement.exc, ast.Call) and _call_name(statement.exc) == "SystemExit":
        value = statement.exc.args[0] if statement.exc.args else None
    return isinstance(value, ast.Constant) and isinstance(value.value, int) and value.value != 0


def python_sites(path: str, *, include_internal: bool = False) -> list[Site]:
    text = (REPO / path).read_text()
    lines = text.splitlines()
    tree = ast.parse(text)
    sites = []
    cache: dict[int, _Messages] = {}

    def marked(node: ast.AST) -> bool:
        return any(NOT_USER_FACING in lines[i - 1] for i in range(node.lineno, (node.end_lineno or node.lineno) + 1))

    for node, function in _functions(tree):
        for body in (getattr(node, "body", None), getattr(node, "orelse", None)):
            if not isinstance(body, list):
                continue
            for statement, following in zip(body, body[1:]):
                if _is_stderr_print(statement) and _is_failure_exit(following) and not (
                        isinstance(statement.value.args[0], ast.Call) and _call_name(statement.value.args[0]) == "str"):
                    if include_internal or not marked(statement):
                        messages = cache.setdefault(id(function), _Messages(function))
                        sites.append(Site(path, statement.lineno, _merge(messages.parts(statement.value.args[0]))))
        message = None
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            name = _call_name(node.exc)
            if name == "SystemExit" and node.exc.args and isinstance(node.exc.args[0], ast.Call):
                continue  # raise SystemExit(main()): a status, not a message
            if not node.exc.args:
                continue
            first = node.exc.args[0]
            if isinstance(first, (ast.List, ast.Attribute)) or (
                    isinstance(first, ast.Call) and _call_name(first) in ("engine_message", "recipe_problem", "str")) or (
                    isinstance(first, ast.JoinedStr) and any(
                        isinstance(v, ast.FormattedValue) and isinstance(v.value, ast.Call)
                        and _call_name(v.value) in ("engine_message", "recipe_problem") for v in first.values)):
                continue  # passes on a message built at another site (Problem, Violation, a caught error)
            message = node.exc.args[-1] if name == "MalformedRowError" else node.exc.args[0]
        elif isinstance(node, ast.Call) and _call_name(node) in ("Problem", "Finding") and len(node.args) >= 3:
            messages = cache.setdefault(id(function), _Messages(function))
            parts = (messages.parts(node.args[0]) + [": "] + messages.parts(node.args[1]) + [" Fix: "]
                     + messages.parts(node.args[2]))
            if include_internal or not marked(node):
                sites.append(Site(path, node.lineno, _merge(parts)))
            continue
        elif isinstance(node, ast.Call) and _call_name(node) == "Violation":
            args = {k.arg: k.value for k in node.keywords}
            positional = dict(zip(("key", "value", "reason", "fix", "context"), node.args))
            args = {**positional, **args}
            messages = cache.setdefault(id(function), _Messages(function))
            parts = (messages.parts(args.get("key")) + [WILD] + messages.parts(args.get("reason")) + [WILD]
                     + messages.parts(args.get("fix")))
            if include_internal or not marked(node):
                sites.append(Site(path, node.lineno, _merge(parts)))
            continue
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "error"
              and isinstance(node.func.value, ast.Name) and node.func.value.id in ("parser", "p", "ap") and node.args):
            message = node.args[0]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "exit"
              and isinstance(node.func.value, ast.Name) and node.func.value.id == "sys" and node.args
              and not isinstance(node.args[0], (ast.Constant, ast.Call)) or
              (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "exit"
               and isinstance(node.func.value, ast.Name) and node.func.value.id == "sys" and node.args
               and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str))):
            message = node.args[0]
        if message is None:
            continue
        if not include_internal and marked(node):
            continue
        messages = cache.setdefault(id(function), _Messages(function))
        sites.append(Site(path, node.lineno, _merge(messages.parts(message))))
    return sorted(sites, key=lambda s: s.line)


# ------------------------------------------------------------------------------------------- shell

_SHELL_VAR = re.compile(r"\$\{[^}]*\}|\$\((?:[^()]|\([^()]*\))*\)|\$\w+|\$[?#@*$!]")


def _shell_string(s: str) -> list[str]:
    parts: list[str] = []
    pos = 0
    for m in _SHELL_VAR.finditer(s):
        parts += [s[pos:m.start()].replace('\\"', '"').replace("\\$", "$"), WILD]
        pos = m.end()
    parts.append(s[pos:].replace('\\"', '"').replace("\\$", "$"))
    return parts


_DOUBLE_QUOTED = r'"((?:[^"\\]|\\.)*)"'


def shell_sites(path: str, *, include_internal: bool = False) -> list[Site]:
    physical = (REPO / path).read_text().splitlines()
    logical: list[tuple[int, str]] = []  # (first line number, the line with its continuations joined)
    i = 0
    while i < len(physical):
        first, line = i, physical[i]
        while line.rstrip().endswith("\\") and i + 1 < len(physical):
            i += 1
            line = line.rstrip()[:-1] + " " + physical[i].strip()
        logical.append((first + 1, line))
        i += 1
    sites = []
    for k, (number, line) in enumerate(logical):
        code = "" if line.lstrip().startswith("#") else line.split(" # ", 1)[0]
        if not code or (NOT_USER_FACING in line and not include_internal):
            continue
        strings = None
        m = re.search(r"\bds4_die ((?:" + _DOUBLE_QUOTED + r"\s*)+)", code)
        if m is None and ">&2" in code:
            following = " ".join(text for _, text in logical[k:k + 2])
            if re.search(r"\bexit [12]\b", following):
                m = re.search(r"\becho ((?:" + _DOUBLE_QUOTED + r"\s*)+)>&2", code)
        if m is not None:
            strings = [q.group(1) for q in re.finditer(_DOUBLE_QUOTED, m.group(1))]
            sites.append(Site(path, number, _merge(_shell_string(" ".join(strings)))))
    return sites


def all_sites(*, include_internal: bool = False) -> list[Site]:
    sites = [s for p in SCOPE for s in python_sites(p, include_internal=include_internal)]
    return sites + [s for p in SHELL_SCOPE for s in shell_sites(p, include_internal=include_internal)]


# -------------------------------------------------------------------------------------------- page


def catalogue_blocks(page: Path = PAGE) -> list[tuple[int, str]]:
    """(first line number, text) of every ```error block of the page."""
    blocks, current, start = [], None, 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if current is None and line.strip() == "```error":
            current, start = [], number + 1
        elif current is not None and line.strip() == "```":
            blocks.append((start, "\n".join(current)))
            current = None
        elif current is not None:
            current.append(line)
    return blocks


@dataclass
class Report:
    sites: list[Site]
    undocumented: list[Site]  # sites whose pattern matches no catalogue block
    short: list[Site]  # sites with too little literal text to recognise
    stale: list[tuple[int, str]]  # (page line, text) of catalogue lines that no site covers

    @property
    def ok(self) -> bool:
        return not (self.undocumented or self.short or self.stale)


def check(page: Path = PAGE, sites: list[Site] | None = None) -> Report:
    sites = all_sites() if sites is None else sites
    blocks = catalogue_blocks(page)
    short = [s for s in sites if len(s.literal.strip()) < MIN_LITERAL]
    covered = [[False] * len(text) for _, text in blocks]
    undocumented = []
    for site in sites:
        if site in short:
            continue
        pattern, found = site.pattern, False
        for b, (_, text) in enumerate(blocks):
            for m in pattern.finditer(text):
                found = True
                for k in range(m.start(), m.end()):
                    covered[b][k] = True
        if not found:
            undocumented.append(site)
    stale = []
    for b, (start, text) in enumerate(blocks):
        offset = 0
        for k, line in enumerate(text.split("\n")):
            span = covered[b][offset:offset + len(line)]
            if line.strip() and not any(span):
                stale.append((start + k, line))
            offset += len(line) + 1
    return Report(sites, undocumented, short, stale)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--page", type=Path, default=PAGE, help="the catalogue page (default docs/troubleshooting.md)")
    args = parser.parse_args(argv)
    report = check(args.page)
    print(f"{len(report.sites)} raising sites in {len(SCOPE)} modules and {len(SHELL_SCOPE)} launchers; "
          f"{len(catalogue_blocks(args.page))} catalogue blocks on {args.page.name}")
    for site in report.short:
        print(f"too short to recognise: {site.where()}: {site.example()!r} (say more, or mark it '{NOT_USER_FACING} why')")
    for site in report.undocumented:
        print(f"not on the page: {site.where()}:\n    {site.example()}")
    for line, text in report.stale:
        print(f"on the page but raised nowhere: {args.page.name}:{line}: {text}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
