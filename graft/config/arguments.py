"""argparse types for the commands' numeric flags: a count of 0 layers, repeats or steps is one clear
error when the flags are parsed (`graft bench update: error: argument --layers: must be at least 1
(got 0)`, exit 2), before any model is built or server started. Without them such flags ran on:
a tiny model of 0 layers was written, a bench of 0 repeats failed on an empty median at the end."""

import argparse
from collections.abc import Callable


def at_least(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """The argparse `type` of an integer flag whose value must be `minimum` or more (and `maximum` or
    less, where given)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer (got {text!r})") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum} (got {value})")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be at most {maximum} (got {value})")
        return value

    parse.__name__ = f"integer >= {minimum}" if maximum is None else f"integer in {minimum}..{maximum}"
    parse.minimum, parse.maximum = minimum, maximum
    return parse


def add_config_arguments(parser: argparse.ArgumentParser, example: str) -> None:
    """A config command's CONFIG and its repeatable `-o KEY=VALUE` overrides (train, eval, config)."""
    parser.add_argument("config", nargs="?", default=None, help="YAML config (omit for the defaults)")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                        help=f"dotted override, e.g. -o {example} (repeatable)")


COUNT = at_least(1)  # layers, sizes, steps, repeats, ...: one at least
SEED = at_least(0)
PORT = at_least(1, 65_535)  # a TCP port
