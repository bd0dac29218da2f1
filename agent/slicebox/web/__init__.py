"""slicebox's own HTTP/1.1 over asyncio streams: the agent's API server and a keep-alive client.

The agent used aiohttp for both, and paid about 12 MiB of resident memory for it — more than
the rest of its HTTP needs put together. What it needs is small: HTTP/1.1 on unix sockets,
keep-alive, chunked bodies in both directions with backpressure, ``100 Continue``, and a
handful of routes. ``message`` is the wire format both sides share. The server is the subset
of ``aiohttp.web`` the agent's handlers were written against: ``app`` (routes, middlewares,
typed state), ``request`` and ``response`` (what a handler is given and answers with),
``connection`` (one client's requests, parsed by h11), ``heads`` (h11 held strict, and what a
head must be), ``limits`` (what one uid may hold) and ``server`` (accepting, serving, closing).
``client`` is a connection pool for Docker's socket and the agent's own async client.

Imports the standard library and h11 (the server's parser); nothing of slicebox outside this
package.
"""
