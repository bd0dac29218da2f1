"""The one exception tree of slicebox.

Every error a caller can cause or meet carries a stable, machine-readable ``code`` and a human
``message`` that says what to do. Foreign exceptions (D-Bus, Docker, OS) are mapped to this tree
at the edge with ``raise ... from exc``. A class's code is its default; a raise site may pass a
more specific one (``PolicyViolation(..., code="policy_mount")``). Every code answered is listed,
with its status and what the caller should do, in :mod:`slicebox.model.codes`.

    SliceboxError                 code: a stable snake_case string, http: the API status
    ├── InvalidRequest            the caller's input cannot be accepted as it is (400)
    │   ├── InvalidName           a user or project name that cannot map to a unit name
    │   ├── InvalidLimit          a size, cpu or pids value that is unparsable or out of range
    │   ├── PolicyViolation       a request the security policy refuses (privileged, host net...)
    │   ├── InvalidCommand        an exec argv that is empty, or a string without shell: true
    │   ├── InvalidTimeout        an exec timeout that is not a positive number of seconds
    │   └── TooLarge              a file transfer over the agent's size cap (413)
    ├── Forbidden                 the caller may not act for the user it named (403)
    ├── AdmissionRefused          limits no ceiling, or no room left under one, allows (409)
    ├── SandboxNotRunning         the sandbox exists but is stopped or paused (409)
    ├── NotFound                  no such sandbox, or not the caller's (404)
    │   └── SandboxNotFound       no container with that id (an exec target)
    ├── ShareFull                 the caller holds its whole share of a bound (429, Retry-After)
    ├── Unavailable               a backend or system service is not reachable (503)
    │   ├── ImageUnavailable      an image is not present and cannot be pulled
    │   ├── ImagePullFailed       a registry failed or stopped answering during a pull
    │   └── Busy                  a bound for all callers is full now (503, Retry-After)
    ├── HostError                 the host misbehaved (a systemd job failed, cgroupfs odd) (500)
    └── ConfigError               the agent's configuration file is unreadable or invalid (500)
"""


class SliceboxError(Exception):
    """Root of every slicebox error: a stable ``code`` and a message saying what to do."""

    code = "internal"
    http_status = 500
    retry_after: int | None = None  # seconds; answered as Retry-After when set

    def __init__(self, message: str, *, code: str | None = None, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field  # the request field at fault, where there is one
        if code is not None:
            self.code = code

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


class InvalidRequest(SliceboxError):
    code = "invalid_request"
    http_status = 400


class InvalidName(InvalidRequest):
    code = "invalid_name"


class InvalidLimit(InvalidRequest):
    code = "invalid_limit"


class PolicyViolation(InvalidRequest):
    code = "policy_violation"


class InvalidCommand(InvalidRequest):
    code = "invalid_command"


class InvalidTimeout(InvalidRequest):
    code = "invalid_timeout"


class Forbidden(SliceboxError):
    code = "forbidden"
    http_status = 403


class AdmissionRefused(SliceboxError):
    code = "admission_refused"
    http_status = 409


class NotFound(SliceboxError):
    code = "not_found"
    http_status = 404


class SandboxNotFound(NotFound):
    code = "sandbox_not_found"


class TooLarge(InvalidRequest):
    code = "file_too_large"
    http_status = 413


class SandboxNotRunning(SliceboxError):
    code = "sandbox_not_running"
    http_status = 409


class Unavailable(SliceboxError):
    code = "unavailable"
    http_status = 503


class ShareFull(SliceboxError):
    """The caller's requests in flight hold its whole share of something the agent bounds per
    user (core/shares.py): retrying once one of them ends can succeed."""

    code = "share_full"
    http_status = 429
    retry_after = 1


class Busy(Unavailable):
    """Every caller's requests together hold all of a bound: retrying later can succeed."""

    code = "busy"
    retry_after = 1


class HostError(SliceboxError):
    code = "host_error"
    http_status = 500


class ConfigError(SliceboxError):
    code = "invalid_config"
    http_status = 500


class ImageUnavailable(Unavailable):
    code = "image_unavailable"


class ImagePullFailed(Unavailable):
    """The image exists as far as anyone knows, but its registry failed or went silent."""

    code = "image_pull_failed"
