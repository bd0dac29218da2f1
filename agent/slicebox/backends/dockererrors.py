"""The Docker backend's errors: Docker's answers and docker-py's exceptions, as slicebox's.

One mapping, kept apart from the calls that meet them: the threads' client
(:mod:`slicebox.backends.dockerapi`), the event loop's (:mod:`slicebox.backends.dockerjson`), the
exec stream's start (:mod:`slicebox.backends.dockerstream`) and an image's pull
(:mod:`slicebox.backends.dockerpull`) all
answer in the same terms, so a 404 or a 409 means the same whichever of them met it.

A 409 "removal ... already in progress" on remove means someone else removes the container,
which makes a concurrent destroy idempotent instead of an error (:class:`RemovalInProgress`,
which the backend's remove takes as "not removed by this call").
"""

from __future__ import annotations

from slicebox.backends.base import START_FAILED_CODE
from slicebox.model.errors import (
    HostError,
    ImageUnavailable,
    InvalidRequest,
    SandboxNotFound,
    SandboxNotRunning,
    SliceboxError,
    Unavailable,
)

# What Docker answers (500) when containerd's own deadlines pass on a host too busy to meet them:
# a shim's or a task's call under load ("failed to delete container from containerd: context
# deadline exceeded", a start's "failed to create shim task: context deadline exceeded"). The
# request was sound and was not carried out, or not all of it; the same request a moment later
# goes through (seen in CI's guest of one emulated CPU under five users' load, issue 58).
ENGINE_OVERRUN = "context deadline exceeded"


def engine_overrun(text: str) -> bool:
    """Whether Docker's answer ``text`` says containerd ran out of its own time."""
    return ENGINE_OVERRUN in text.lower()


class RemovalInProgress(HostError):
    """Docker's 409 on a remove while another removal of the container runs."""

    code = "removal_in_progress"


def map_status(status: int | None, text: str, what: str) -> SliceboxError:
    """Docker's answer ``status``/``text`` to a request about ``what``, as a slicebox error."""
    if status == 404:
        return SandboxNotFound(f"no sandbox {what}: check the id (it may have been destroyed)")
    if status == 409:
        return _conflict(text, what)
    if status is not None and 400 <= status < 500:
        return InvalidRequest(
            f"Docker refused {what}: {text}; check the image, command, user and mounts",
            code=START_FAILED_CODE,
        )
    return HostError(f"Docker failed on {what} (HTTP {status}): {text}")


def _conflict(text: str, what: str) -> SliceboxError:
    lowered = text.lower()
    if "removal of container" in lowered and "already in progress" in lowered:
        return RemovalInProgress(f"sandbox {what} is being removed already")
    if "already in use" in lowered:
        return HostError(
            f"a sandbox named {what} exists already ({text}); create again for a new id",
            code="sandbox_name_conflict",
        )
    return SandboxNotRunning(f"sandbox {what} is not running ({text}): create a new one")


def map_error(exc: Exception, what: str) -> SliceboxError | None:
    """docker-py's exception ``exc`` as a slicebox error; None for a foreign one (a bug)."""
    import docker.errors
    import requests.exceptions

    if isinstance(exc, docker.errors.ImageNotFound):
        return ImageUnavailable(
            f"image of {what} not found ({exc.explanation}); pull or load it, or choose another"
        )
    if isinstance(exc, docker.errors.APIError):
        return map_status(exc.status_code, str(exc.explanation), what)
    if isinstance(exc, docker.errors.DockerException | requests.exceptions.RequestException):
        return Unavailable(f"the Docker daemon is not reachable ({exc}); is docker.service up?")
    return None


def unpullable(image: str, why: str) -> ImageUnavailable:
    """``image`` is missing and its pull failed (``why``)."""
    return ImageUnavailable(
        f"image {image!r} is not on this host and could not be pulled ({why}); "
        "load it with `docker load`/`docker pull` or choose another image"
    )
