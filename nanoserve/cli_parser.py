"""The command line's argument parser: an error is one line naming the bad flag or value, with
the usage of the (sub)command it was given to, never a screen of usage.

Imports nothing heavy: parsing happens before torch is loaded."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Sequence
from typing import NoReturn


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are `PROG: error: WHAT; usage: PROG [options] POSITIONALS`.
    Its subcommands' parsers are of its class (add_subparsers) and refuse unknown arguments
    themselves, so a misspelled flag is named with the subcommand's usage."""

    def add_subparsers(self, **kwargs) -> argparse._SubParsersAction:
        kwargs.setdefault("parser_class", SubcommandParser)
        return super().add_subparsers(**kwargs)

    def short_usage(self) -> str:
        """`PROG [options] POSITIONALS`, one line whatever the number of options."""
        words = [self.prog, "[options]"]
        for action in self._actions:
            if action.option_strings or action.help == argparse.SUPPRESS:
                continue
            name = action.metavar or action.dest
            words.append(f"[{name}]" if action.nargs in ("?", "*") else name)
        return " ".join(words)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}; usage: {self.short_usage()} (--help lists the options)\n")

    def unrecognized(self, extras: Sequence[str]) -> str:
        """What is wrong with arguments left unparsed: the unknown flags (each with the nearest known
        one) when there are any, since a stray value usually follows from a flag misread."""
        flags = [extra.split("=", 1)[0] for extra in extras if extra.startswith("-")]
        if not flags:
            return f"unrecognized argument{'s' if len(extras) > 1 else ''}: {' '.join(extras)}"
        known = [flag for action in self._actions for flag in action.option_strings]
        named = []
        for flag in flags:
            close = difflib.get_close_matches(flag, known, n=1)
            named.append(f"{flag} (did you mean {close[0]}?)" if close else flag)
        return f"unrecognized option{'s' if len(flags) > 1 else ''}: {', '.join(named)}"

    def parse_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(self.unrecognized(extras))
        return parsed


class SubcommandParser(OneLineErrorParser):
    """A subcommand's parser: its leftover arguments are an error of its own (argparse would hand
    them up to the top-level parser, which names the wrong command's usage)."""

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None):
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(self.unrecognized(extras))
        return parsed, extras
