"""How many of roving's public signatures take or return ``Any``.

A public signature is a function of a public module (no part of its dotted name begins with an
underscore), or a method of a public class there, whose name does not begin with an underscore
(``__init__`` counts: it is the class's signature); it takes or returns ``Any`` when ``Any`` appears
anywhere in one of its annotations (``Optional[Any]``, ``Dict[str, Any]``, ``Callable[..., Any]``).

    python3 scripts/any_signatures.py [--exclude roving.pipeline] [--list]

prints the count, the share, and (with --list) each signature that has one. tests/test_any_signatures.py
holds the share under its bound.
"""
from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Sequence

SRC = Path(__file__).resolve().parent.parent / "src" / "roving"


@dataclass(frozen=True)
class Signature:
    """One public signature: where it is, and whether ``Any`` is in its annotations."""

    module: str
    name: str
    line: int
    has_any: bool


def _module_name(path: Path) -> str:
    parts = ("roving", *path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _mentions_any(node: ast.AST) -> bool:
    return any((isinstance(n, ast.Name) and n.id == "Any") or (isinstance(n, ast.Attribute) and n.attr == "Any")
               or (isinstance(n, ast.Constant) and isinstance(n.value, str) and "Any" in n.value)
               for n in ast.walk(node))


def _has_any(fn: ast.AST) -> bool:
    assert isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
    a = fn.args
    annotations = [x.annotation for x in (*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg)
                   if x is not None and x.annotation is not None]
    if fn.returns is not None:
        annotations.append(fn.returns)
    return any(_mentions_any(x) for x in annotations)


def _public(name: str) -> bool:
    return not name.startswith("_") or name == "__init__"


def signatures(exclude: Sequence[str] = ()) -> List[Signature]:
    """Every public signature of roving's public modules, outside the packages ``exclude`` names."""
    out: List[Signature] = []
    for path in sorted(SRC.rglob("*.py")):
        module = _module_name(path)
        if any(part.startswith("_") for part in module.split(".")) or \
                any(module == e or module.startswith(e + ".") for e in exclude):
            continue
        out.extend(_in_body(module, ast.parse(path.read_text()).body, ""))
    return out


def _in_body(module: str, body: List[ast.stmt], owner: str) -> Iterator[Signature]:
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _public(node.name):
            if node.name == "__init__" and not owner:
                continue
            yield Signature(module, owner + node.name, node.lineno, _has_any(node))
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            yield from _in_body(module, node.body, owner + node.name + ".")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exclude", nargs="*", default=[], help="packages left out (roving.pipeline)")
    ap.add_argument("--list", action="store_true", help="each signature that has Any")
    args = ap.parse_args()
    found = signatures(args.exclude)
    with_any = [s for s in found if s.has_any]
    if args.list:
        for s in with_any:
            print(f"{s.module}:{s.line} {s.name}")
    share = len(with_any) / max(1, len(found))
    print(f"{len(with_any)} of {len(found)} public signatures take or return Any: {share:.1%}")


if __name__ == "__main__":
    main()
