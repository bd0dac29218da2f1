"""Admission as one pure pass (core.admission.decide): the decided spec, or its refusal, from
the request, the backend that runs it, the configuration and the caller's ids alone, with
nothing asked of the host."""

from __future__ import annotations

import pwd

import pytest

from slicebox.core.admission import decide
from slicebox.model.config import parse_config
from slicebox.model.errors import InvalidRequest, PolicyViolation
from slicebox.model.spec import Backend, MountKind, SandboxSpec

MiB = 1024 * 1024
HOST_MEMORY = 4096 * MiB
ROOTS = parse_config('bind_roots = ["/srv/ws/{user}"]\n')
WORKSPACE = {"kind": "host", "path": "/srv/ws/al-ice/code"}


def spec(**fields: object) -> SandboxSpec:
    return SandboxSpec.model_validate({"user": "al-ice", "project": "p", **fields})


@pytest.fixture(autouse=True)
def no_user_database(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass reads nothing but its arguments: not the user database either."""

    def asked(user: str) -> pwd.struct_passwd:
        raise AssertionError(f"admission looked {user} up")

    monkeypatch.setattr(pwd, "getpwnam", asked)


def test_a_host_workspace_is_decided_as_a_bind_at_workspace_run_as_the_caller() -> None:
    decided = decide(spec(workspace=WORKSPACE), Backend.DOCKER, ROOTS, HOST_MEMORY, (1234, 99))
    made = decided.admitted
    assert made.spec.run_as == "1234:99"
    assert [(m.kind, m.source, m.target) for m in made.spec.mounts] == [
        (MountKind.BIND, "/srv/ws/al-ice/code", "/workspace")
    ], "its source as asked: the kernel pins it when the create acts"
    assert made.image == ROOTS.default_image
    assert made.placement.names.project == "slicebox-al\\x2dice-p.slice"
    assert decided.plugin_hosts == ()


def test_without_a_host_directory_the_configured_default_runs_it_whoever_asks() -> None:
    decided = decide(spec(), Backend.DOCKER, ROOTS, HOST_MEMORY, None)
    assert decided.admitted.spec.run_as == ROOTS.default_run_as


def test_a_host_workspace_run_as_another_uid_is_refused() -> None:
    with pytest.raises(PolicyViolation) as refused:
        decide(
            spec(workspace=WORKSPACE, run_as="1000:1000"),
            Backend.DOCKER,
            ROOTS,
            HOST_MEMORY,
            (1234, 99),
        )
    assert (refused.value.code, refused.value.field) == ("policy_run_as", "run_as")


def test_a_user_the_host_lacks_is_refused_a_host_directory_after_the_policy_is() -> None:
    with pytest.raises(PolicyViolation) as refused:
        decide(spec(workspace=WORKSPACE), Backend.DOCKER, ROOTS, HOST_MEMORY, None)
    assert (refused.value.code, refused.value.field) == ("policy_run_as", "workspace")
    with pytest.raises(PolicyViolation) as first:
        decide(spec(workspace=WORKSPACE, privileged=True), Backend.DOCKER, ROOTS, HOST_MEMORY, None)
    assert first.value.code == "policy_privileged"


def test_the_backend_that_runs_it_is_decided_and_refuses_what_it_cannot_give() -> None:
    native = decide(spec(backend="docker"), Backend.NATIVE, ROOTS, HOST_MEMORY, None)
    assert native.admitted.spec.backend is Backend.NATIVE, "native in Docker's place"
    with pytest.raises(InvalidRequest) as refused:
        decide(spec(cap_add=["NET_ADMIN"]), Backend.NATIVE, ROOTS, HOST_MEMORY, None)
    assert (refused.value.code, refused.value.field) == ("backend_unsupported", "cap_add")
    with pytest.raises(InvalidRequest) as pooled:
        decide(spec(), Backend.NATIVE, ROOTS, HOST_MEMORY, None, pool_key="k")
    assert (pooled.value.code, pooled.value.field) == ("backend_unsupported", "pool")


def test_a_wasm_sandbox_s_allow_list_is_decided_as_its_plugin_s_hosts() -> None:
    config = parse_config("[[egress.rule]]\n")
    wasm = {"backend": "wasm", "memory": "128m", "wasm": {"sha256": "a" * 64}}
    allow = ["api.example.org", "*.example.net"]
    decided = decide(
        spec(**wasm, network={"egress": {"allow": allow}}), Backend.WASM, config, HOST_MEMORY, None
    )
    assert decided.plugin_hosts == ("api.example.org", "*.example.net")
    with pytest.raises(InvalidRequest, match="no port") as refused:
        decide(
            spec(**wasm, network={"egress": {"allow": ["api.example.org:443"]}}),
            Backend.WASM,
            config,
            HOST_MEMORY,
            None,
        )
    assert (refused.value.code, refused.value.field) == ("backend_unsupported", "network")
