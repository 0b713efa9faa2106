"""The `prfaas` command: parses options, calls the library, prints. Nothing else lives here.

Each area registers its own subcommands (``register(subparsers)``) so that this file stays thin.
A `UserError` becomes one line on stderr and exit status 2; Ctrl-C exits 130 after cleanup; a reader
that goes away (``prfaas ... | head``) ends the command quietly with 141, as a shell tool killed by
SIGPIPE would.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Callable

from testbed import __version__
from testbed.errors import UserError

COMMAND_MODULES = (
    "testbed.net.commands",  # doctor, net up/exec/down, clean, calibrate
    "testbed.models.commands",  # kv-size, profile
    "traffic.commands",  # traffic stats/generate
    "analysis.commands",  # model, report, wall, replay-estimator
    "analysis.scenario_check",  # check
    "labs.commands",  # lab list/show/start/check
    "experiments.commands",  # run, quickstart, sweep, experiment, capacity, reproduce
)


USER_ERROR_EXIT = 2  # a command refused a user mistake in one line (`guarded`), as argparse exits on its own errors
INTERRUPTED_EXIT = 130  # a command ended by Ctrl-C, SIGTERM or SIGHUP after its cleanup ran (`guarded`)
PROG_ATTR = "_prog"  # where a parsed namespace keeps the name of the command that parsed it


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        """A command (a parser without subcommands) takes its options anywhere among its positionals:
        ``prfaas lab check 2 --answers a.yaml runs/x runs/y`` was "unrecognized arguments: runs/x runs/y"
        (argparse gives a list of positionals only what comes before the first option; 2026-12-07)."""
        if getattr(self, "_intermixing", False) or self._subparsers is not None or not self._intermixable():
            return self._named(*super().parse_known_args(args, namespace))
        self._intermixing = True
        try:
            return self._named(*self.parse_known_intermixed_args(args, namespace))
        finally:
            self._intermixing = False

    def _named(self, namespace: argparse.Namespace, rest: list[str]) -> tuple[argparse.Namespace, list[str]]:
        """Record the innermost (sub)command's name, ``prfaas net up``, as `PROG_ATTR`: a subcommand parses first
        and its values are copied up, so an outer parser finds it set. A `UserError` is then printed under the
        same name as argparse's own errors of that command (one prefix per command, not "prfaas:" for some)."""
        if not getattr(namespace, PROG_ATTR, None):
            setattr(namespace, PROG_ATTR, self.prog)
        return namespace, rest

    def _intermixable(self) -> bool:
        """What argparse can intermix: no ``nargs=REMAINDER`` positional (``prfaas net exec HOST -- CMD...``, where what
        follows the host is the command's own) and no positional in a mutually exclusive group; argparse raises
        TypeError for those, which was a traceback for `prfaas net exec`."""
        return not any(a.nargs in (argparse.REMAINDER, argparse.PARSER) for a in self._actions if not a.option_strings) and \
            not any(not a.option_strings for g in self._mutually_exclusive_groups for a in g._group_actions)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="prfaas", description="Prefill-as-a-Service testbed: cross-datacenter PD serving on an emulated WAN.")
    parser.add_argument("--version", action="version", version=f"prfaas-testbed {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        try:
            return _dispatch(argv)
        finally:
            sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
    except BrokenPipeError:
        return _reader_gone()


def _dispatch(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return guarded(getattr(args, PROG_ATTR, None) or "prfaas", lambda: args.func(args))


def guarded(prog: str, body: Callable[[], int | None]) -> int:
    """Run a command's body as every `prfaas` subcommand runs: a `UserError` is one line on stderr (exit 2),
    Ctrl-C one line after cleanup (exit 130). The benchmarks' entry points run through it too, so
    stopping a long benchmark prints one line, not a traceback."""
    from testbed.interrupts import raise_keyboard_interrupt

    # SIGTERM and SIGHUP end a command as Ctrl-C does, so its `finally` blocks run: a multi-run command
    # (`--executor local:N`) stops its runs' processes instead of leaving them running orphaned, as a
    # `kill` of the parent did before (2026-12-02)
    raise_keyboard_interrupt()
    try:
        return int(body() or 0)
    except UserError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return USER_ERROR_EXIT
    except KeyboardInterrupt as exc:
        print(f"{prog}: interrupted; cleaned up", file=sys.stderr)
        for note in getattr(exc, "__notes__", ()):  # what the interrupt left, e.g. an incomplete run folder (`runs.run_once`)
            print(f"{prog}: {note}", file=sys.stderr)
        return INTERRUPTED_EXIT


def _reader_gone() -> int:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail a second time."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 141


if __name__ == "__main__":
    sys.exit(main())
