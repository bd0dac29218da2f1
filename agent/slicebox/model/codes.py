"""Every error code slicebox can answer, in one registry: the table in ``docs/errors.md`` and
the ``ErrorBody.code`` enum of the OpenAPI document are both generated from it.

A code is a promise to callers: scripts branch on it, so it never changes meaning. A unit test
scans the code base and fails when a code is raised but missing here, or listed here but never
raised. ``python3 -m slicebox.model.codes > docs/errors.md`` regenerates the table.
"""

from pydantic import ConfigDict

from slicebox.model.base import Model


class ErrorCode(Model):
    """One code: the HTTP status it is answered with (``None``: raised by the client only)."""

    model_config = ConfigDict(frozen=True)

    code: str
    status: int | None
    when: str
    action: str


def _c(code: str, status: int | None, when: str, action: str) -> ErrorCode:
    return ErrorCode(code=code, status=status, when=when, action=action)


CODES: tuple[ErrorCode, ...] = (
    # The request as sent: shape and fields (400).
    _c(
        "malformed_json",
        400,
        "The body is not valid JSON, or holds a number too long to read.",
        "Send one JSON object.",
    ),
    _c(
        "invalid_field",
        400,
        "A field has the wrong type or value, is unknown, or a required one is missing "
        "(`field` names it).",
        "Fix the named field; the schemas are in GET /v1/openapi.json.",
    ),
    _c(
        "invalid_command",
        400,
        "An exec's `argv` is empty, has NUL bytes, or is a string without `shell: true`.",
        "Pass a list of arguments, or one string with `shell: true`.",
    ),
    _c(
        "invalid_timeout",
        400,
        "An exec's `timeout` is not more than 0 and at most 86400 seconds.",
        "Give a positive number of seconds, at most a day.",
    ),
    _c(
        "invalid_limit",
        400,
        "`memory`, `cpus` or `pids` is unparsable, zero or negative.",
        "Use bytes or sizes like '256MB', cpus like 0.5, pids as a whole number.",
    ),
    _c(
        "invalid_name",
        400,
        "A user or project name is empty, too long, or cannot map to a systemd unit name.",
        "Use letters, digits, '-', '.', '_'; keep user and project short.",
    ),
    _c(
        "invalid_ttl",
        400,
        "`ttl_seconds` is not a positive whole number.",
        "Give a positive number of seconds.",
    ),
    _c(
        "invalid_mount",
        400,
        "A mount is malformed: no source, a relative target, or an unknown kind.",
        "Give `source`, an absolute `target` and `kind` bind or volume.",
    ),
    _c(
        "invalid_workspace",
        400,
        "A workspace is malformed: an unknown kind, a host workspace without `path`, or a "
        "volume workspace with one.",
        "Give `kind` host with `path`, or `kind` volume with an optional `name` and `keep`.",
    ),
    _c(
        "invalid_request",
        400,
        "The request is well-formed but cannot be done as asked (a child naming another root "
        "task, an extend where no deadlines are enforced).",
        "Read the message; change the request as it says.",
    ),
    _c(
        "output_cap_over_budget",
        400,
        "An exec's `output_cap` needs more memory than the agent's whole exec output budget "
        "(`exec_output_budget`), or than one user's share of it; it could never run.",
        "Ask for output_cap at most the bytes the message names, or an operator raises "
        "exec_output_budget.",
    ),
    # Security policy (400): refused before anything is created.
    _c(
        "policy_privileged",
        400,
        "The sandbox asks for privileged mode.",
        "Drop `privileged`; add only the capabilities you need.",
    ),
    _c(
        "policy_host_namespace",
        400,
        "The sandbox asks for the host's network, PID or IPC namespace.",
        "Leave `pid_mode`/`ipc_mode` out; use network 'none'.",
    ),
    _c(
        "policy_network",
        400,
        "The network is not one the config allows.",
        "Use one of the allowed networks the message lists.",
    ),
    _c(
        "policy_egress",
        400,
        "An egress allow-list names hosts or networks no `[[egress.rule]]` allows the user and "
        "project, or none allows them egress at all (there is none by default); or it names "
        "loopback, link-local (metadata), `0.0.0.0/0`, the host's own addresses, the egress "
        "subnet or Docker's bridge subnets, which no rule opens.",
        "Leave the named entries out, or ask an operator for a rule that allows them (and, for "
        "an internal network, to list it in `[egress] internal_networks`).",
    ),
    _c(
        "policy_capability",
        400,
        "`cap_add` names a capability outside the allow-list.",
        "Choose from the capabilities the message lists.",
    ),
    _c(
        "policy_mount",
        400,
        "A bind mount is outside the caller's own roots (`bind_roots`, `{user}` being the "
        "caller), or a volume name is invalid.",
        "Mount a directory under one of your roots; name volumes with letters, digits, '_.-'.",
    ),
    _c(
        "policy_root",
        400,
        "The sandbox would run as uid 0: the caller is not in `root_users`, or it has a "
        "writable host mount (a root process there could plant setuid-root files on the host).",
        "Leave `run_as` out (a non-root uid), name a non-root user, or mount the host "
        "directory read-only.",
    ),
    _c(
        "policy_run_as",
        400,
        "`run_as` names someone the sandbox may not run as: with any host directory (a host "
        "workspace or a bind mount, read-only too) a sandbox runs as its owner's uid and "
        "primary gid only (no other uid, no foreign group such as docker's or root's), and "
        "without one never with gid 0 unless the user is in `root_users`; or the user has no "
        "entry on the host, so a sandbox with a host directory cannot run as them.",
        "Leave `run_as` out (a host directory's sandbox then runs as you), or use a volume "
        "workspace and a non-root uid:gid of your choice.",
    ),
    _c(
        "git_clone_failed",
        400,
        "A git workspace's clone failed in the new sandbox (the remote, ref or credentials, "
        "no network, no git in the image, or the clone timeout); nothing of the sandbox is "
        "left.",
        "Read git's words in the message; fix the url, ref or token, give the sandbox a "
        "network that reaches the remote, or an image with git.",
    ),
    _c(
        "volume_not_owned",
        403,
        "The volume is another user's workspace volume.",
        "Use a volume name of your own; `slicebox` volumes belong to the user who made them.",
    ),
    _c(
        "volume_foreign",
        400,
        "The volume exists but slicebox did not make it (no lineage labels): it may hold "
        "another service's data.",
        "Choose another name, or give a workspace of kind volume and let slicebox make it.",
    ),
    _c(
        "mount_escape",
        400,
        "A bind mount's source leaves its root on the way down: a symlink, '..', another "
        "mount, or a component that is not a directory.",
        "Name the real directory, with no symlink, '..' or other mount below the root.",
    ),
    _c(
        "bind_root_unsafe",
        400,
        "The bind root itself cannot be trusted: a symlink on its path from `/`, a directory "
        "above the user's own one that is not root's or is writable by others, or the user's "
        "own directory owned by someone else (the agent refuses every bind under it).",
        "Ask the operator to fix the root (`slicebox doctor` names the directory); never "
        "replace a directory on a bind root's path by a symlink.",
    ),
    _c(
        "mount_source_missing",
        400,
        "A bind mount's source does not exist (slicebox never creates one, nor lets Docker).",
        "Create the directory first, then the sandbox.",
    ),
    _c(
        "mount_changed",
        400,
        "A bind mount's source was replaced between its check and Docker's mount (the "
        "sandbox was removed again).",
        "Keep the source still while the sandbox is created, and create it again.",
    ),
    _c(
        "ttl_too_long",
        400,
        "A create's or an extend's `ttl_seconds` is more than the agent's `max_ttl_seconds` "
        "(24 h unless configured).",
        "Ask for at most the maximum the message names and extend the deadline before it "
        "passes, or ask an operator to raise `max_ttl_seconds`.",
    ),
    _c(
        "container_start_failed",
        400,
        "Docker created the container but could not start it (no such program, user or "
        "workdir in the image).",
        "Check image, command, user and workdir.",
    ),
    # Who may do what.
    _c(
        "unauthorized",
        401,
        "A scrape of the metrics listener (`[metrics] listen`) without the bearer token, or "
        "with another one.",
        "Send `Authorization: Bearer <token>` with the token of `[metrics] token_file` "
        "(Prometheus: `authorization: {credentials_file: ...}`).",
    ),
    _c(
        "no_peer_credentials",
        403,
        "The agent could not read the caller's identity (not a unix socket connection).",
        "Connect over the agent's unix socket.",
    ),
    _c(
        "unknown_user",
        403,
        "The caller's uid has no entry in the host's user database (a process of a user "
        "namespace, a deleted user), and no `[callers] unknown_uids` range admits it.",
        "Call as a user of the host, or ask an operator to allow the uid range "
        "(`[callers] unknown_uids`, served as the one user `[callers] unknown_user`).",
    ),
    _c(
        "policy_nested",
        400,
        "A nested create asks more than allowed: `nested` above the configured bounds for "
        "the user or project (`[nested]`), a depth or child count past the parent's, nesting "
        "for a user without a host account, or a child wider than its parent (larger limits, "
        "a wider network, a workspace, bind, capability or backend the parent does not have, "
        "another project, a deadline past the parent's).",
        "Ask for no more than the message says; a child inherits its parent's project and is "
        "at most its parent.",
    ),
    _c(
        "nested_refused",
        403,
        "The request came in on a nested sandbox's own socket and is not one that socket "
        "serves (the level tree, capacity, pools, the reaper, metrics), or the connection is "
        "not from a process of that sandbox.",
        "Ask from the sandbox itself; what a nested sandbox may do is in docs/nested.md.",
    ),
    _c(
        "nested_limit",
        429,
        "The nested sandbox has as many children alive as its `max_children`, or has created "
        "`creates_per_minute` children in the last minute.",
        "Destroy a child first, or wait the Retry-After seconds.",
    ),
    _c(
        "not_member",
        403,
        "The caller's user is not a member of the callers' group (`slicebox`, or `[callers] "
        "group`) nor of `slicebox-admin` in the host's user database, checked on every "
        "request (a removal counts within seconds, whatever groups the caller's process has).",
        "Ask an operator to add your user to group slicebox.",
    ),
    _c(
        "forbidden",
        403,
        "The caller may not act for the user it named, or may not run the reaper.",
        "Leave `user` out, or ask an admin (root, group slicebox-admin).",
    ),
    # What exists.
    _c(
        "not_found",
        404,
        "No such sandbox, task or user among the caller's own (another user's answers this too).",
        "List sandboxes to see the ids.",
    ),
    _c(
        "sandbox_not_found",
        404,
        "The container of an exec target is gone.",
        "List sandboxes; create a new one.",
    ),
    _c("unknown_route", 404, "No such route.", "See GET /v1/openapi.json."),
    _c(
        "method_not_allowed",
        405,
        "The route does not take that method.",
        "See GET /v1/openapi.json.",
    ),
    _c(
        "body_too_large",
        413,
        "The request body is larger than 1 MiB.",
        "Send a smaller body; stream files instead.",
    ),
    _c(
        "bad_request",
        400,
        "The HTTP request itself was refused (the status says why).",
        "Send a well-formed HTTP/1.1 request.",
    ),
    _c(
        "too_many_requests",
        429,
        "Your uid holds its share of the agent's socket (64 connections, 32 requests in "
        "flight, 32 MiB of request bodies being read) or everyone together holds all of it; "
        "refused at once, with `Retry-After`. Root is held to the totals only. GET /v1/health "
        "is always answered.",
        "Finish or close some of your connections and requests, then retry after the "
        "`Retry-After` seconds.",
    ),
    # Files in and out of a sandbox (PUT/GET /v1/sandboxes/{id}/files, `slicebox cp`).
    _c(
        "file_not_found",
        404,
        "The path does not exist in the sandbox (for a single-file upload: its directory).",
        "Check the path with `slicebox exec ID -- ls -l DIR`; create the directory first.",
    ),
    _c(
        "file_wrong_kind",
        400,
        "The path is not what the transfer takes: a tar upload to something that is not a "
        "directory, a single-file upload onto a directory, a single-file download of what is "
        "not a regular file.",
        "Use format=tar for directories; name a directory to extract a tar into.",
    ),
    _c(
        "file_too_large",
        413,
        "A transfer is larger than the agent's `files_max_bytes` (1 GiB unless configured); it "
        "was stopped there, and what an upload had written stays in the sandbox.",
        "Send less (split it), or ask an operator to raise `files_max_bytes`.",
    ),
    _c(
        "file_tools_missing",
        400,
        "The sandbox's image has no `sh`, or no `tar` for a tar transfer: transfers run them "
        "inside the sandbox.",
        "Use an image with a POSIX shell and tar (busybox, alpine, debian), or single files "
        "(format=file) where only tar is missing.",
    ),
    _c(
        "file_transfer_failed",
        400,
        "tar or cat in the sandbox failed (no permission, no space left, a damaged archive); "
        "the message quotes its error.",
        "Fix what the quoted error says (permissions, space, the archive) and send again.",
    ),
    # State conflicts (409).
    _c(
        "admission_refused",
        409,
        "The sandbox's own limits exceed its project's or user's ceiling; or, where "
        "`[admission]` counts a resource, a level's sandboxes and creates in flight hold all "
        "of it that the level admits.",
        "Ask for at most what the message (or GET /v1/capacity) says is left, destroy "
        "sandboxes you no longer need, or ask an operator to raise that ceiling.",
    ),
    _c(
        "credentials_share_exceeded",
        409,
        "The git credentials of the caller's sandboxes together would take more than each "
        "user's share of the agent's credential store (`[credentials] user_share`).",
        "Destroy sandboxes you no longer need (their credentials go with them), or ask an "
        "operator to raise `[credentials] user_share`.",
    ),
    _c(
        "sandbox_not_running",
        409,
        "The sandbox exists but is stopped or paused.",
        "Destroy it and create a new one.",
    ),
    _c(
        "sandbox_paused",
        409,
        "The sandbox is paused (`slicebox pause`): an exec or a file transfer cannot run in it.",
        "Resume it first (`slicebox resume`, POST .../resume), or send the request with "
        "`?resume=1`.",
    ),
    _c(
        "snapshot_quota",
        409,
        "The user's snapshots are at `[snapshots] max_count` or `max_bytes`; the message says "
        "what they hold.",
        "Delete snapshots you no longer need (`slicebox snapshots rm NAME`), or ask an operator "
        "to raise the bounds.",
    ),
    _c(
        "snapshot_exists",
        409,
        "The user has a snapshot of that name already.",
        "Choose another name, or delete the old snapshot first.",
    ),
    _c(
        "snapshot_workspace",
        400,
        "The sandbox's /workspace is a host directory, which a snapshot would copy host files "
        "from; or a fork was given a `workspace` or a mount at /workspace, which would hide the "
        "snapshot's own.",
        "Snapshot a sandbox with its own /workspace (tmpfs or volume); fork without `workspace` "
        "and without a mount at /workspace.",
    ),
    # A user's share of what the agent bounds for all callers (429, with Retry-After).
    _c(
        "output_share_full",
        429,
        "The caller's execs in flight hold so much of its share of the exec output budget "
        "(`[shares] user_share` of `exec_output_budget`) that this one does not fit now.",
        "Wait for one of your execs to end (read its answer), ask for a smaller output_cap, "
        "or retry after Retry-After seconds.",
    ),
    _c(
        "stream_share_full",
        429,
        "The caller has its whole share (`[shares] user_share`) of `streams_in_flight` "
        "streamed execs and runs answering.",
        "End one of your streams, or exec without streaming, or retry after Retry-After seconds.",
    ),
    _c(
        "transfer_share_full",
        429,
        "The caller has its whole share (`[shares] user_share`) of `transfers_in_flight` file "
        "transfers moving.",
        "Let one of your transfers finish, or send several files as one tar, or retry after "
        "Retry-After seconds.",
    ),
    _c(
        "pull_share_full",
        429,
        "The caller's creates are pulling its whole share (`[shares] user_share`) of "
        "`pulls_in_flight` distinct images at once.",
        "Let one of your pulls finish (or cancel its create), or retry after Retry-After "
        "seconds; a create of an image already being pulled waits for that pull instead.",
    ),
    # The host (5xx): not the caller's fault.
    _c(
        "unavailable",
        503,
        "Docker or another system service is not reachable.",
        "Retry later; an operator checks docker.service.",
    ),
    _c(
        "busy",
        503,
        "Execs in flight hold so much of the agent's exec output budget that this one does not "
        "fit now.",
        "Retry later, or ask for a smaller output_cap.",
    ),
    _c(
        "streams_busy",
        503,
        "Streamed execs and runs of all callers take every one of the agent's "
        "`[shares] streams_in_flight`.",
        "Retry after Retry-After seconds, or exec without streaming.",
    ),
    _c(
        "transfers_busy",
        503,
        "File transfers of all callers take every one of the agent's "
        "`[shares] transfers_in_flight`.",
        "Retry after Retry-After seconds.",
    ),
    _c(
        "pulls_busy",
        503,
        "Image pulls of all callers take every one of the agent's `[shares] pulls_in_flight`.",
        "Retry after Retry-After seconds.",
    ),
    _c(
        "image_unavailable",
        503,
        "The image is not on the host and could not be pulled.",
        "Load or pull the image on the host, or choose another.",
    ),
    _c(
        "image_pull_failed",
        503,
        "The image's registry failed during the pull, or said nothing for the agent's "
        "`pull_timeout_seconds`; the message quotes the registry's words.",
        "Retry later, or check the registry (its address is in the image's name); nothing of "
        "the failed pull is left on the host.",
    ),
    _c(
        "backend_unavailable",
        503,
        "The request names a backend this agent cannot run now.",
        "Leave `backend` out for the default, or ask an operator which backends `slicebox "
        "doctor` reports as available.",
    ),
    _c(
        "egress_unavailable",
        503,
        "A sandbox asks for network egress and this host cannot enforce it (no nftables "
        "binding, or the agent runs without egress).",
        "Use network 'none', or ask an operator to install python3-nftables.",
    ),
    _c(
        "egress_failed",
        500,
        "nftables refused slicebox's egress rules for a sandbox; nothing of it was made.",
        "Retry; if it persists, an operator reads the agent's journal (`nft list table inet "
        "slicebox`).",
    ),
    _c(
        "backend_unsupported",
        400,
        "The backend the sandbox runs on cannot give what the request asks for (the native "
        "backend has no image, mounts, volumes, credentials, added capabilities or network).",
        "Leave the field the message names out, or ask for `backend: docker`.",
    ),
    _c(
        "wasm_invalid",
        400,
        "A wasm sandbox's plugin is not a WebAssembly binary, is over 64 MiB or is not a "
        "regular file, or an exec in it does not name one exported function.",
        "Compile the plugin (wat2wasm for text) and give argv as [function]; the input is the "
        "exec's stdin.",
    ),
    _c(
        "wasm_not_found",
        404,
        "A wasm sandbox names its plugin by a sha256 the agent does not hold (never uploaded, "
        "or evicted from its cache).",
        "Upload the plugin (`module`) or name its path instead.",
    ),
    _c(
        "wasm_store_full",
        503,
        "The agent's wasm plugin store holds its limit in other users' plugins and the caller's "
        "own in use, so an uploaded plugin does not fit now; no one's plugin was evicted for it.",
        "Retry later (other users' plugins age out as they upload more), or end a wasm sandbox "
        "of yours; an operator may raise the store's limit.",
    ),
    _c(
        "docker_host_unsupported",
        503,
        "The agent's DOCKER_HOST is neither unix:///path nor tcp://host:port.",
        "An operator sets DOCKER_HOST in the agent's environment to a supported value.",
    ),
    _c(
        "docker_tls_unsupported",
        503,
        "The agent's DOCKER_HOST asks for Docker over TLS, which slicebox does not speak.",
        "An operator points DOCKER_HOST at the daemon's unix socket or a local plain tcp port.",
    ),
    _c(
        "docker_context_unknown",
        503,
        "The Docker context the agent's user chose (DOCKER_CONTEXT, or currentContext in the "
        "Docker config) has no Docker endpoint.",
        "An operator creates that context, chooses another, or sets DOCKER_HOST.",
    ),
    _c(
        "docker_config_invalid",
        503,
        "The Docker config of the agent's user (config.json, or a context's meta.json) cannot "
        "be read as JSON.",
        "An operator mends the file, or sets DOCKER_HOST to choose the engine.",
    ),
    _c(
        "sandbox_name_conflict",
        500,
        "Docker already has a container with the new sandbox's name.",
        "Create again: each create gets a new id.",
    ),
    _c(
        "host_error",
        500,
        "systemd, cgroupfs, netlink or Docker misbehaved.",
        "Retry; if it persists, an operator reads the agent's journal.",
    ),
    _c(
        "unit_exists",
        500,
        "systemd already has a unit of the name the agent tried to start.",
        "Retry; the agent treats an existing slice as success, so this is a bug to report.",
    ),
    _c(
        "no_such_unit",
        500,
        "systemd does not know the unit the agent asked about.",
        "Retry; it was probably removed at the same moment.",
    ),
    _c(
        "broken_labels",
        500,
        "A container's slicebox labels are incomplete or malformed (not made by a complete "
        "create).",
        "Nothing: the reaper removes such containers on its next pass.",
    ),
    _c(
        "invalid_config",
        500,
        "The agent's config file is unreadable or invalid.",
        "An operator fixes /etc/slicebox/config.toml as the message says and reloads.",
    ),
    _c("internal", 500, "An unexpected failure inside the agent.", "Read the agent's journal."),
    # Raised by the Python client, never answered by the agent.
    _c(
        "agent_unreachable",
        None,
        "The client cannot connect to the agent's socket.",
        "Check slicebox.socket is active and that you are in group slicebox.",
    ),
    _c(
        "agent_no_answer",
        None,
        "The agent closed the connection or sent no HTTP answer.",
        "Retry; read the agent's journal.",
    ),
    _c(
        "agent_bad_answer",
        None,
        "The agent answered with a body this client cannot read as the route's model.",
        "Check that the client and the agent are the same version (slicebox --version and "
        "GET /v1/health).",
    ),
    _c(
        "mcp_unavailable",
        None,
        "`slicebox mcp` finds no MCP SDK in its own Python and no MCP environment at "
        "$SLICEBOX_MCP_PYTHON or /opt/slicebox-mcp/bin/python.",
        "Install it as the message and docs/mcp.md say: a venv with --system-site-packages "
        "and `pip install 'mcp>=1.20,<2'` in it.",
    ),
    _c(
        "http_error",
        None,
        "The agent answered an error without the JSON envelope.",
        "Report it: every error should carry a code.",
    ),
)

BY_CODE = {entry.code: entry for entry in CODES}


def answered() -> list[str]:
    """The codes the agent itself answers, in registry order."""
    return [entry.code for entry in CODES if entry.status is not None]


def markdown() -> str:
    """The table of ``docs/errors.md``."""
    lines = [
        "# slicebox error codes",
        "",
        'Every error answer is `{"code": ..., "message": ..., "field": ...}`; `code` is',
        "stable, `message` says what to do, `field` names the request field at fault.",
        "Generated by `python3 -m slicebox.model.codes`; do not edit by hand.",
        "",
        "| code | HTTP | when | what to do |",
        "|---|---|---|---|",
    ]
    for entry in CODES:
        status = "client" if entry.status is None else str(entry.status)
        lines.append(f"| `{entry.code}` | {status} | {entry.when} | {entry.action} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
