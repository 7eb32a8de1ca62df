"""The documents stay true to the code: every file, symbol and link they name exists, the
structure page names every module, and the README stays a front door."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PACKAGES = ("pipeline", "stages", "gpu", "server", "perf", "tests")
DOCS = ("README.md", "docs/ARCHITECTURE.md", "docs/SERVING.md")
# `path/to/file.py` or `path/to/file.py:Symbol.attribute`
FILE_REFERENCE = re.compile(
    r"((?:[\w.-]+/)+[\w.-]+\.(?:py|c|sh|md|toml|service|env))(?::([\w.]+))?"
)
CLASS_ATTRIBUTE = re.compile(r"([A-Z]\w+)\.(\w+)(?:\(\))?")


def _names(tree: ast.Module) -> set[str]:
    """What a module defines: functions, classes, their methods, class fields and the attributes
    methods assign on self, and module-level names, as `name` and `Class.name`."""
    names: set[str] = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(prefix + child.name)
                if isinstance(child, ast.ClassDef):
                    visit(child, f"{prefix}{child.name}.")
                    names.update(
                        f"{prefix}{child.name}.{sub.attr}"
                        for sub in ast.walk(child)
                        if isinstance(sub, ast.Attribute)
                        and isinstance(sub.ctx, ast.Store)
                        and isinstance(sub.value, ast.Name)
                        and sub.value.id == "self"
                    )
            elif isinstance(child, ast.Assign | ast.AnnAssign):
                targets = child.targets if isinstance(child, ast.Assign) else [child.target]
                for target in targets:
                    elements = target.elts if isinstance(target, ast.Tuple) else [target]
                    names.update(prefix + e.id for e in elements if isinstance(e, ast.Name))

    visit(tree, "")
    return names


@cache
def _index() -> tuple[dict[str, set[str]], dict[str, set[str]], dict[str, set[str]]]:
    """Names per Python file (relative path), the files defining each class, and each class's
    bases (by name)."""
    names: dict[str, set[str]] = {}
    classes: dict[str, set[str]] = {}
    bases: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            relative = str(path.relative_to(ROOT))
            tree = ast.parse(path.read_text(encoding="utf-8"))
            names[relative] = _names(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef):
                    classes.setdefault(node.name, set()).add(relative)
                    bases.setdefault(node.name, set()).update(
                        b.id for b in node.bases if isinstance(b, ast.Name)
                    )
    return names, classes, bases


def _has_attribute(cls: str, attribute: str) -> bool:
    """Whether the class, or a class it is built on, defines the attribute."""
    names, classes, bases = _index()
    if any(f"{cls}.{attribute}" in names[f] for f in classes.get(cls, ())):
        return True
    return any(_has_attribute(base, attribute) for base in bases.get(cls, ()))


def _candidates(reference: str) -> list[Path]:
    """The file a reference names: from the root, or under a package (`rings/plan.py`)."""
    if (ROOT / reference).exists():
        return [ROOT / reference]
    return [p for p in ROOT.glob(f"*/**/{reference}") if ".venv" not in p.parts]


def _unresolved(text: str) -> list[str]:
    names, classes, _ = _index()
    wrong = []
    for quoted in re.findall(r"`([^`\n]+)`", text):
        if match := FILE_REFERENCE.fullmatch(quoted):
            reference, symbol = match.groups()
            files = _candidates(reference)
            if not files:
                wrong.append(f"{quoted}: no such file")
            elif symbol and not any(
                symbol in names.get(str(f.relative_to(ROOT)), set())
                or (f.suffix == ".c" and re.search(rf"\b{re.escape(symbol)}\b", f.read_text()))
                for f in files
            ):
                wrong.append(f"{quoted}: no {symbol} in {reference}")
        elif (match := CLASS_ATTRIBUTE.fullmatch(quoted)) and match.group(1) in classes:
            cls, attribute = match.groups()
            if not _has_attribute(cls, attribute):
                wrong.append(f"{quoted}: {cls} has no {attribute}")
    return wrong


@pytest.mark.parametrize("doc", DOCS)
def test_every_file_and_symbol_a_document_names_exists(doc: str):
    assert _unresolved((ROOT / doc).read_text(encoding="utf-8")) == []


def test_a_renamed_symbol_is_caught():
    assert _unresolved("`stages/scheduler.py:Scheduler.schedule` `Scheduler.stats`") == []
    assert _unresolved("`stages/scheduler.py:Scheduler.plan_everything`") != []
    assert _unresolved("`Scheduler.plan_everything` `stages/no_such_module.py`") != []


@pytest.mark.parametrize("doc", DOCS)
def test_every_link_of_a_document_leads_somewhere(doc: str):
    path = ROOT / doc
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8"))
    local = [t for t in targets if "://" not in t]
    assert [t for t in local if not (path.parent / t).exists()] == []


def test_the_structure_page_names_every_module():
    text = (ROOT / "docs/ARCHITECTURE.md").read_text(encoding="utf-8")
    page = text[text.index("## The structure in one page") : text.index("## Processes and rings")]
    modules = {
        p.name
        for package in ("pipeline", "stages", "gpu", "server", "perf")
        for p in (ROOT / package).glob("**/*.py")
        if p.name not in ("__init__.py", "__main__.py")
    }
    named = {Path(quoted).name for quoted in re.findall(r"`([\w./-]+\.py)`", page)}
    assert sorted(modules - named) == []


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 200
    assert any("make serve" in line for line in lines)
    assert any("make test" in line for line in lines)
