"""slicebox: a systemd-native host agent that runs sandboxes for local AI agents."""

import argparse
from functools import cache


def __getattr__(name: str) -> str:
    """``__version__``, read from the installed package's metadata when first asked for:
    ``importlib.metadata`` is a noticeable part of the agent's and every CLI call's start-up
    (see docs/benchmarks.md), for a string few of them print."""
    if name == "__version__":
        return _version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@cache
def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("slicebox")
    except PackageNotFoundError:  # running from a checkout that is not installed
        return "0.0.0+checkout"


class VersionAction(argparse.Action):
    """``--version`` for a command line: the version is read only when it is asked for."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        parser.exit(message=f"{parser.prog} {_version()}\n")
