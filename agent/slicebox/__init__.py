"""slicebox: a systemd-native host agent that runs sandboxes for local AI agents."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("slicebox")
except PackageNotFoundError:  # running from a checkout that is not installed
    __version__ = "0.0.0+checkout"
