"""No module of roving grows past what a reader takes in: no file over 650 lines and no class over 400
(issue 52's bound; STYLE.md asks for files under about 600). The check reads every module under
src/roving, so a file or class that grows past its bound fails here, with no exceptions listed."""
from __future__ import annotations

import ast
from pathlib import Path
from typing import List

import roving

SRC = Path(roving.__file__).resolve().parent

#: the most lines a module may have
MOST_FILE_LINES = 650
#: the most lines a class may have, from its ``class`` line (or its first decorator) to its last
MOST_CLASS_LINES = 400


def _modules() -> List[Path]:
    found = sorted(SRC.rglob("*.py"))
    assert len(found) > 80, f"only {len(found)} modules found under {SRC}"
    return found


def _class_lines(tree: ast.AST) -> List[tuple]:
    return [(node.name, node.lineno, node.end_lineno - min([node.lineno, *(d.lineno for d in node.decorator_list)]) + 1)
            for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]


def test_no_module_of_roving_is_over_650_lines():
    over = {str(p.relative_to(SRC)): n for p in _modules() if (n := len(p.read_text().splitlines())) > MOST_FILE_LINES}
    assert not over, f"modules over {MOST_FILE_LINES} lines (split them by concept): {over}"


def test_no_class_of_roving_is_over_400_lines():
    over = {f"{p.relative_to(SRC)}:{line} {name}": n for p in _modules()
            for name, line, n in _class_lines(ast.parse(p.read_text())) if n > MOST_CLASS_LINES}
    assert not over, f"classes over {MOST_CLASS_LINES} lines (split them by concept): {over}"


def test_the_class_count_includes_decorators_and_nested_classes():
    tree = ast.parse("@dataclass\nclass A:\n    x: int\n\n    class B:\n        y: int\n")
    assert sorted((name, n) for name, _, n in _class_lines(tree)) == [("A", 6), ("B", 2)]
