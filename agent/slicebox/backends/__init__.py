"""Where sandboxes run: one module (or package) per backend under one interface (``base``).

Everything above this layer (placement, policy, lineage, deadlines, telemetry, audit) is
backend-neutral. Imports only ``model`` and ``host``."""
