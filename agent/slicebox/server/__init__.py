"""The agent process: the HTTP API on the unix socket, its routes, the assembly of real
components, and the systemd-facing daemon (notify, watchdog, reload)."""
