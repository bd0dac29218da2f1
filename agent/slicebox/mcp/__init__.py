"""``slicebox mcp``: slicebox's tools for any agent that speaks the Model Context Protocol.

An MCP server on stdio (the official ``mcp`` Python SDK, its 1.x line) that answers each tool
call with one request to the agent's unix socket through :class:`slicebox.client.AsyncClient`,
as the user who started it: the kernel's identity, the ceilings, the policy and the audit
apply unchanged, and this layer adds no authority of its own.

    inputs   the tools' arguments: models built from the agent's own (``slicebox.model``)
    outputs  answers as JSON for a model to read: bytes as text or base64, truncation stated
    tools    the table: name, description, input model, MCP annotations
    session  what one MCP session holds: the client, the sandboxes it made, their clean-up
    calls    one coroutine per tool, on a session
    server   the SDK's low-level server, its resources, stdio and signals

Only ``server`` and ``tools`` import the SDK; ``python -m slicebox.mcp`` runs it.
"""
