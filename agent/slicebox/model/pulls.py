"""Whose registry credentials an image's pull may send (``[[registry_credentials]]``).

A tenant's pull never uses root's own Docker credentials (``~/.docker/config.json`` of the
agent's user): they are the operator's, and any tenant naming an image of that registry would
pull with them. A pull sends credentials only where the operator granted them, per registry
and per user level, from a file of root's:

    [[registry_credentials]]
    registry = "registry.example.com:5000"  # as in the image's name; "docker.io": Docker Hub
    users = ["alice", "bob"]                # the user levels whose pulls may send them
    auth_file = "/etc/slicebox/registries/team/config.json"  # root's, mode 0600

``auth_file`` is a Docker client config (``DOCKER_CONFIG=/etc/slicebox/registries/team docker
login registry.example.com:5000`` writes one); only its ``auths`` entries are read, never a
credential helper. Every other pull is anonymous.
"""

from pathlib import PurePosixPath

from pydantic import ConfigDict, Field

from slicebox.model.base import Model

DOCKER_HUB = "docker.io"  # the registry of an image whose name names none


class RegistryCredential(Model):
    """One grant: ``users``' pulls from ``registry`` send the credentials in ``auth_file``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    registry: str = Field(
        pattern=r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?(:[0-9]{1,5})?$",
        description='the registry as the image\'s name gives it (host[:port]); "docker.io" '
        "for Docker Hub",
    )
    users: frozenset[str] = Field(
        min_length=1, description="the user levels whose pulls from it may send these"
    )
    auth_file: PurePosixPath = Field(
        description="root's Docker client config (mode 0600) holding the registry's auths entry"
    )


def registry_of(image: str) -> str:
    """The registry ``image``'s name pulls from, as the Docker client reads it: a first
    component with a dot, a colon or ``localhost`` names one, anything else is Docker Hub's."""
    first, slash, _ = image.partition("/")
    if slash and ("." in first or ":" in first or first == "localhost"):
        return first
    return DOCKER_HUB


def credential_for(
    grants: tuple[RegistryCredential, ...], user: str, image: str
) -> RegistryCredential | None:
    """The first grant of ``image``'s registry to ``user``; None: the pull is anonymous."""
    registry = registry_of(image)
    return next((g for g in grants if g.registry == registry and user in g.users), None)
