"""`cupyflash` / `python -m cupyflash` command line: a dispatcher over subcommand modules.

Each subcommand lives in its own module exposing `build_parser(parser)` (adds its arguments to
the given parser) and `run_from_args(args) -> int` (the exit code). To add a command (e.g. `run`,
`autotune`), append a `Subcommand` to `SUBCOMMANDS`; modules are imported only when their
command runs, so `cupyflash info` stays fast and one broken command cannot break the others.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from typing import Sequence

__all__ = ["Subcommand", "SUBCOMMANDS", "main"]


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    module: str  # importable module with build_parser(parser) and run_from_args(args)


SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand("info", "versions, NVRTC, driver and devices, kernel cache", "cupyflash.info"),
    Subcommand("prewarm", "compile a config set for named archs into a cache directory (no GPU needed)",
               "cupyflash.prewarm"),
    Subcommand("run", "the main job: one attention forward, timed and checked against a reference",
               "cupyflash.run_attention"),
    Subcommand("autotune", "time the candidate configs on this GPU and store the fastest per shape",
               "cupyflash.autotune"),
)


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cupyflash", description="Runtime-compiled FlashAttention forward kernels.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in SUBCOMMANDS:
        sub.add_parser(cmd.name, help=cmd.help, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `cupyflash` console script; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {cmd.name: cmd for cmd in SUBCOMMANDS}
    # Two stages: pick the command from the first word, then let only that module define and parse
    # its own arguments.
    if not argv or argv[0] not in commands:
        parser = _top_parser()
        if not argv:
            parser.print_help()
            return 2
        parser.parse_args(argv)  # prints help or the "invalid choice" error and exits
        return 2
    cmd = commands[argv[0]]
    module = importlib.import_module(cmd.module)
    parser = argparse.ArgumentParser(prog=f"cupyflash {cmd.name}", description=cmd.help)
    module.build_parser(parser)
    return int(module.run_from_args(parser.parse_args(argv[1:])) or 0)


if __name__ == "__main__":
    sys.exit(main())
