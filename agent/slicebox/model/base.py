"""The base of every slicebox model: its validator is built at its first use, not at import.

Building a pydantic model's core schema is most of what importing slicebox costs, the agent's
start and every CLI command's alike, for models most processes never use (a CLI command sends
one request and reads one answer; the agent answers what it is asked; the figures are in
docs/benchmarks.md). Deferred, each model is built once, at its first validation or
serialization, and the models a process never uses cost it neither time nor memory.
"""

from pydantic import BaseModel, ConfigDict


class Model(BaseModel):
    """A pydantic model built on first use (``defer_build``); subclasses add their config."""

    model_config = ConfigDict(defer_build=True)
