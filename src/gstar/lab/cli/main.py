"""Entry point of the ``gstar`` console script: one subcommand per module of this package (docs/design.md
section 3); argparse prints DESCRIPTION, plain text, as the help's opening."""

from __future__ import annotations

import argparse
import importlib
import sys

DESCRIPTION = ("gstar: FlashAttention in Python and Triton (causal, GQA, sliding windows, sink tokens, learned "
               "sinks; forward and backward). Run 'gstar COMMAND --help' for a command's options.")

# name -> (module, one-line help); each module has add_arguments(parser) and run(args) -> exit status
COMMANDS = {
    "check": ("gstar.lab.cli.check", "run the autograder's ten stages: correctness against the naive oracle, then "
                                 "speed and memory against naive PyTorch"),
    "bench": ("gstar.lab.cli.bench", "benchmark gstar against its peers on this machine, or print the markdown "
                                 "tables of saved results (--table)"),
    "roofline": ("gstar.lab.cli.roofline", "measure this GPU's memory and matmul ceilings (JSON for gstar bench)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gstar", description=DESCRIPTION)
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
