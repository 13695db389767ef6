"""Entry point of the ``gstar`` console script: one subcommand per module of this package."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help); each module has add_arguments(parser) and run(args) -> exit status
COMMANDS = {
    "check": ("gstar.cli.check", "run the nine-stage autograder (correctness, then speed and memory vs PyTorch)"),
    "bench": ("gstar.cli.bench", "benchmark gstar against its peers on this machine"),
    "roofline": ("gstar.cli.roofline", "measure this GPU's memory and matmul ceilings (JSON for gstar bench)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gstar", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return importlib.import_module(args._module).run(args)


if __name__ == "__main__":
    sys.exit(main())
