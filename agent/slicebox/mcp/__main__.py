"""``python -m slicebox.mcp``: what ``slicebox mcp`` runs, in-process or in its own venv."""

from slicebox.mcp.server import main

raise SystemExit(main())
