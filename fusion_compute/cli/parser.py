"""The `fusion` parser's own rules: it never guesses, answers a wrong command line in one line, and
its --help groups the flags and shows every default.

- No prefix matching (`allow_abbrev=False`): `--worker 2` or `--mode` read as `--model` are refused,
  not taken for another flag.
- A bad value or an unknown flag: one line on stderr and exit 2, no usage dump (`--help` has it).
- A command given without its subcommand (`fusion`, `fusion keys`, `fusion audit`) prints that
  command's help on stderr and exits 2.
- Flags are declared in named groups (`help_groups`), shown in the order a command asks for them:
  adding a flag to a group is one line, `g["workers"].add_argument(...)`.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

# Every group a command may show, keyed by the name its flags are declared under. Titles are what
# --help prints; each command picks its groups and their order (prompt and sampling first).
HELP_GROUPS = {
    "prompt": "prompt and output",
    "sampling": "sampling",
    "serving": "serving",
    "chat": "chat",
    "workers": "workers and model",
    "network": "network and identity",
    "recovery": "when a worker is lost or slow (docs/resilience.md)",
    "speculative": "speculative decoding (docs/speculative.md)",
    "audit": "audit",
    "logging": "logging (stderr)",
    "testing": "negative controls and tests",
}


class HelpFormatter(argparse.HelpFormatter):
    """Shows every flag's default: the help text's own words where it names one ("default ..."), else
    the value argparse holds. A default of None means "decided at run time"; the help says how."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            "default" in text
            or not action.option_strings
            or action.default in (None, False, True, argparse.SUPPRESS)
            or text == argparse.SUPPRESS
        ):
            return text
        return f"{text} (default %(default)s)" if text else "default %(default)s"


class FusionParser(argparse.ArgumentParser):
    """argparse.ArgumentParser with the rules above; subcommand parsers are made of the same class."""

    def __init__(self, *args: Any, **kw: Any):
        kw.setdefault("allow_abbrev", False)
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kw)
        self.commands: Any = None  # the subcommands' action, once add_subparsers made it

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        a, extra = self.parse_known_args(args, namespace)
        if extra:  # named by the subcommand that was given them: `fusion generate: error: ...`
            self.innermost(a).error(f"unrecognized arguments: {' '.join(extra)}")
        return a

    def innermost(self, a: argparse.Namespace) -> FusionParser:
        """The parser of the (sub)command `a` was parsed for: `fusion audit verify`'s for `audit verify`."""
        p = self
        while p.commands is not None and getattr(a, p.commands.dest, None) in p.commands.choices:
            p = p.commands.choices[getattr(a, p.commands.dest)]
        return p

    def error(self, message: str) -> Any:  # argparse's contract: never returns
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")

    def add_subparsers(self, **kw: Any) -> Any:
        # Not `required`: argparse would answer "the following arguments are required: cmd". Without a
        # subcommand this parser's `func` is left at `missing_subcommand`, which shows its help.
        kw["required"] = False
        kw.setdefault("metavar", "COMMAND")
        self.set_defaults(func=self.missing_subcommand)
        self.commands = super().add_subparsers(**kw)
        return self.commands

    def missing_subcommand(self, _a: argparse.Namespace) -> int:
        self.print_help(sys.stderr)
        return 2


def help_groups(p: argparse.ArgumentParser, *names: str) -> dict[str, Any]:
    """Argument groups of `p` by name (HELP_GROUPS), shown by --help in the order given."""
    return {name: p.add_argument_group(HELP_GROUPS[name]) for name in names}


class StoreFlag(argparse.Action):
    """A value stored under `dest`, and the spelling given (`dest`_flag) for messages about it: a flag
    with an alias (`--max-tokens`, `--max-new-tokens`) is then named as the user typed it."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_flag", option_string)


def flag_name(a: argparse.Namespace, dest: str, default: str) -> str:
    """How the user spelled the flag stored in `dest` (StoreFlag), else `default`."""
    return getattr(a, f"{dest}_flag", None) or default
