"""Print the agent's OpenAPI document: ``python3 -m slicebox.server.openapi > docs/openapi.json``.

The document is generated from the same route list the agent serves; the copy in the repo is
checked against it by the tests, so it cannot drift.
"""

from __future__ import annotations

import json
from typing import Any

from slicebox.server.api import openapi_document
from slicebox.server.routes import ROUTES


def document() -> dict[str, Any]:
    return openapi_document(ROUTES)


def main() -> int:
    print(json.dumps(document(), indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
