"""For people and scripts: the ``slicebox`` command, the Python client and ``doctor``.

Imports only ``model``: a client needs none of the agent's machinery."""
