"""MkDocs hooks: pages made at build time from the code and the results, so that they cannot drift.

- ``reference/cli.md``: every command, subcommand and option of ``roving``, read from its argparse parsers
  (``roving.cli.build_parser``).
- ``benchmarks.md``: ``benchmarks/RESULTS.md`` as it is, its links into the repository made plain text
  (the site holds ``docs/`` only).
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
_LINK = re.compile(r"(!?)\[([^\]]*)\]\(([^)#][^)]*)\)")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _option(action: argparse.Action) -> str:
    names = ", ".join(f"`{n}`" for n in action.option_strings) or f"`{action.metavar or action.dest}`"
    if action.option_strings and action.nargs != 0:
        names += f" `{action.metavar or action.dest.upper()}`" if not action.choices else ""
    return names


def _rows(parser: argparse.ArgumentParser) -> list[str]:
    rows = []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        help_text = "" if action.help in (None, argparse.SUPPRESS) else action.help % vars(action)
        if action.choices:
            help_text += f" (one of: {', '.join(str(c) for c in action.choices)})"
        if action.default not in (None, False, argparse.SUPPRESS) and action.option_strings:
            help_text += f" (default: `{action.default}`)"
        rows.append(f"| {_option(action)} | {_cell(help_text)} |")
    return rows


def _subparsers(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            found += [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return found


def _command(parser: argparse.ArgumentParser, summary: str, depth: int) -> list[str]:
    out = [f"{'#' * depth} `{parser.prog}`", ""]
    if summary or parser.description:
        out += [_cell(summary or parser.description or ""), ""]
    out += ["```text", parser.format_usage().strip(), "```", ""]
    rows = _rows(parser)
    if rows:
        out += ["| argument | what it does |", "|---|---|", *rows, ""]
    for _, help_text, sub in _subparsers(parser):
        out += _command(sub, help_text, min(depth + 1, 4))
    return out


def cli_page() -> str:
    """The CLI reference as Markdown, from the parsers the ``roving`` command itself parses with."""
    from roving.cli import build_parser

    head = ["# Command line", "",
            "Made from the `roving` command's own parsers at each build: what is here is what it accepts.",
            "Every command also takes `-h`, `--help`: its usage and options.", ""]
    return "\n".join(head + _command(build_parser(), "", 2)) + "\n"


def benchmarks_page() -> str:
    """benchmarks/RESULTS.md with its repository links (scripts, plots) turned into code text or images."""
    def plain(m: re.Match) -> str:
        bang, text, target = m.groups()
        if target.startswith(("http://", "https://")):
            return m.group(0)
        if bang:
            return f"`benchmarks/{target}`"
        return f"{text} (`{target}`)"

    return _LINK.sub(plain, RESULTS.read_text())


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, "reference/cli.md", content=cli_page()))
    files.append(File.generated(config, "benchmarks.md", content=benchmarks_page()))
    return files
