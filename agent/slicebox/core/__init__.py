"""The agent's logic: policy and placement, the slice tree, the sandbox lifecycle, deadlines,
exec, telemetry, the reaper, and the service that authorizes and audits each action."""
