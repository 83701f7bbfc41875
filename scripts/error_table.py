"""The documentation's table of roving's errors (docs/reference/errors.md), made from the error classes.

Every public exception class defined in a module of roving is a row: its name, its bases, the public place
to import it from, and the first paragraph of its docstring. tests/test_error_table.py fails when the
page's table differs from this one; after adding, moving or rewording an error, rewrite it with

    python3 scripts/error_table.py --write docs/reference/errors.md

(without --write: print the table). The table sits between the two marker lines below, on that page.
"""
from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import re
import sys
from pathlib import Path
from typing import List, Tuple

#: where the table is kept, from the repository's root
PAGE = "docs/reference/errors.md"

BEGIN = "<!-- errors: made by scripts/error_table.py, checked by tests/test_error_table.py -->"
END = "<!-- /errors -->"
#: the order of the table: the layers, lowest first (tests/test_layering.py has the full map)
ORDER = ("roving.errors", "roving.config", "roving.backends", "roving.transport", "roving.process", "roving.pool",
         "roving", "roving.pipeline")


def error_classes() -> List[type]:
    """Every public exception class defined at the top level of a module of roving, in table order."""
    import roving

    src = Path(roving.__file__).resolve().parent
    found: List[Tuple[int, str, int, type]] = []
    for path in sorted(src.rglob("*.py")):
        parts = ("roving", *path.relative_to(src).with_suffix("").parts)
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if name.endswith("__main__"):
            continue  # running it is what importing it does
        classes = [node for node in ast.parse(path.read_text()).body
                   if isinstance(node, ast.ClassDef) and not node.name.startswith("_")]
        if not classes:
            continue
        module = importlib.import_module(name)
        for node in classes:
            cls = getattr(module, node.name)
            if isinstance(cls, type) and issubclass(cls, BaseException) and cls.__module__ == name:
                rank = max((i for i, p in enumerate(ORDER) if name == p or name.startswith(p + ".")),
                           key=lambda i: len(ORDER[i]), default=len(ORDER))
                found.append((rank, name, node.lineno, cls))
    return [cls for *_, cls in sorted(found, key=lambda f: f[:3])]


def import_path(cls: type) -> str:
    """The shortest public place ``cls`` can be imported from: roving, its package, or its module."""
    parts = cls.__module__.split(".")
    candidates = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    for where in candidates:
        if any(p.startswith("_") for p in where.split(".")):
            continue
        if getattr(importlib.import_module(where), cls.__name__, None) is cls:
            return f"{where}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__name__}"


def base_name(base: type) -> str:
    """How the table names a base: a builtin or roving's own by its name, another library's by its public
    package (``multiprocessing.ProcessError``, ``concurrent.futures.BrokenProcessPool``)."""
    module = base.__module__
    if module == "builtins" or module.startswith("roving"):
        return base.__name__
    for public in ("multiprocessing", "concurrent.futures"):
        if (module == public or module.startswith(public + ".")) and \
                getattr(importlib.import_module(public), base.__name__, None) is base:
            return f"{public}.{base.__name__}"
    return f"{module}.{base.__name__}"


def _meaning(cls: type) -> str:
    doc = inspect.getdoc(cls) if cls.__doc__ else ""
    first = (doc or "").split("\n\n")[0]
    text = " ".join(first.split())
    text = re.sub(r":(?:class|func|meth|mod|attr|exc):`~?(?:[\w.]+\.)?([\w]+)`", r"`\1`", text)
    text = text.replace("``", "`")
    return text.replace("|", "\\|")


def table() -> str:
    """The table's markdown, with the marker lines."""
    rows = [BEGIN, "| error | is a | import from | what it means |", "|---|---|---|---|"]
    for cls in error_classes():
        bases = ", ".join(base_name(b) for b in cls.__bases__)
        rows.append(f"| `{cls.__name__}` | {bases} | `{import_path(cls)}` | {_meaning(cls)} |")
    rows.append(END)
    return "\n".join(rows)


def documented_table(text: str) -> str:
    """The table as it is in a page's ``text``, marker lines included; ValueError without them."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the page has no error table between {BEGIN!r} and {END!r}")
    return text[start:end + len(END)]


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", metavar="PAGE", help=f"replace the table in this file ({PAGE})")
    args = parser.parse_args(argv)
    made = table()
    if args.write is None:
        print(made)
        return 0
    path = Path(args.write)
    text = path.read_text()
    path.write_text(text.replace(documented_table(text), made))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
