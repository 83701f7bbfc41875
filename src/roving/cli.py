"""The `roving` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="roving")
    subparsers = parser.add_subparsers(dest="command", required=True)
    from roving.pipeline.cli import add_pipeline_parser

    add_pipeline_parser(subparsers)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
