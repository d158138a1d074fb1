"""The staged pass's rule: no function in ``scheduler/policy`` over 100 lines, so
each stage stays a unit a reader can hold (and test) on its own."""

from __future__ import annotations

import ast
from pathlib import Path

import scheduler.policy

LIMIT = 100
ROOT = Path(scheduler.policy.__file__).parent


def long_functions(root: Path, limit: int) -> list[str]:
    """``path:line name (n lines)`` for every function (methods and nested ones
    too) whose definition, decorators excluded, spans more than ``limit`` lines."""
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert node.end_lineno is not None
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    rel = path.relative_to(root.parent.parent)
                    out.append(f"{rel}:{node.lineno} {node.name} ({lines} lines)")
    return out


def test_no_policy_function_is_over_100_lines():
    assert long_functions(ROOT, LIMIT) == []


def test_the_guard_names_a_long_function(tmp_path):
    pkg = tmp_path / "scheduler" / "policy"
    pkg.mkdir(parents=True)
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (pkg / "big.py").write_text(f"def short():\n    pass\n\n\ndef big():\n{body}\n")
    assert long_functions(pkg, LIMIT) == [
        f"scheduler/policy/big.py:5 big ({LIMIT + 1} lines)"
    ]
