"""The code stays readable in pieces: no function (Triton kernels aside) runs past a screen."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
MAX_FUNCTION_LINES = 80
PACKAGES = ("pipeline", "stages", "gpu", "server", "perf", "tests")


def _is_triton_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any(
        "triton.jit" in ast.unparse(decorator) or ast.unparse(decorator) == "jit"
        for decorator in node.decorator_list
    )


def test_no_function_is_longer_than_a_screen():
    long = []
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES and not _is_triton_kernel(node):
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} {lines}")
    assert long == []
