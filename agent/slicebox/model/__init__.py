"""Values and wire models: names, limits, specs, labels, errors, config, the API bodies.

Pure and dependency-free within slicebox: every other layer imports from here, this layer
imports from none of them.

Its modules do not use ``from __future__ import annotations``: pydantic reads a model's field
annotations when the class is made, and an annotation kept as a string is compiled and evaluated
there (a ``typing.ForwardRef`` each, for every field of every model the agent's start makes; see
docs/benchmarks.md), where a real annotation costs nothing more. A name not yet defined (a
method returning its own class) is written in quotes.
"""
