"""Files in and out of a sandbox on the wire: the query that names what to move, and the answers.

A transfer names one absolute path inside the sandbox and a format: ``tar`` (a directory or a
file as a tar stream, which is what ``slicebox cp`` sends and takes, like ``docker cp``) or
``file`` (one regular file's bytes as they are). The path is only normalized here, never
checked against a list: it is resolved inside the sandbox's own mount namespace, by the
sandbox's own user (:mod:`slicebox.core.files`), so the container confines it.
"""

import posixpath
from enum import StrEnum
from typing import Annotated

from pydantic import ConfigDict, Field, field_validator

from slicebox.model.base import Model

MAX_PATH = 4096  # PATH_MAX: longer names no program in the sandbox could open


class FileFormat(StrEnum):
    TAR = "tar"  # a tar stream: a directory's tree, or one file with its mode
    FILE = "file"  # one regular file's bytes


class FileKind(StrEnum):
    DIRECTORY = "directory"
    FILE = "file"
    OTHER = "other"  # a device, socket, FIFO or a dangling symlink


class FilesQuery(Model):
    """``?path=...&format=...`` of a files route, parsed once at the edge."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    path: Annotated[str, Field(min_length=1, max_length=MAX_PATH)]
    format: FileFormat = FileFormat.TAR

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("path must be absolute inside the sandbox, like /workspace/out")
        if "\0" in value:
            raise ValueError("path cannot contain NUL bytes")
        return posixpath.normpath(value).replace("//", "/", 1)

    @property
    def parent(self) -> str:
        return posixpath.dirname(self.path)

    @property
    def name(self) -> str:
        """The last component as tar names it below ``parent`` (``.`` for ``/``): with ``./``
        in front, a name starting with ``-`` is never an option."""
        return "./" + posixpath.basename(self.path) if self.path != "/" else "."


class FileStat(Model):
    """What is at a path in the sandbox (``GET .../files/stat``): what ``slicebox cp`` asks
    before it decides whether a copy goes into a directory or becomes its own name."""

    model_config = ConfigDict(frozen=True)

    path: str
    kind: FileKind


class Transferred(Model):
    """A finished upload: where it went and how many bytes of body it took."""

    model_config = ConfigDict(frozen=True)

    path: str
    format: FileFormat
    bytes: int
