"""Finding the container engine on a real host: the agent through a tcp:// DOCKER_HOST (its
calls, its exec streams and its deadline timer's expiry all going there), and ``slicebox
doctor`` through a Docker context and through a user's rootless socket. Each other daemon is a
relay inside the guest to the guest's own Docker. One container in all."""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from slicebox.core.deadlines import Deadlines
from slicebox.host.systemd import PystemdSystemd
from tests.host.agentunits import curl_health, installed_agent
from tests.host.helpers import sh, unique
from tests.host.relay import Relay

pytestmark = pytest.mark.host

USER = "sbxengine"  # an ordinary user: the system's socket is not theirs to open


def doctor_checks(argv: list[str], env: dict[str, str]) -> dict[str, dict[str, object]]:
    done = subprocess.run(
        [*argv, "slicebox", "--json", "doctor"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        timeout=300,
    )
    return {check["name"]: check for check in json.loads(done.stdout)}


def test_the_agent_uses_a_tcp_docker_host_for_everything() -> None:
    with Relay.tcp() as relay:
        url = f"tcp://127.0.0.1:{relay.port}"
        # The shipped unit allows the agent IPv4 sockets (the egress resolver asks upstream
        # over them), so an IPv4 tcp:// DOCKER_HOST needs no drop-in; an IPv6 one still does,
        # and the agent says so (tests/unit/test_docker_backend.py).
        with installed_agent(environment={"DOCKER_HOST": url}):
            sh("systemctl", "start", "slicebox.socket")
            assert curl_health()["engine"] == f"{url} (DOCKER_HOST)"
            project = unique("eng")
            box = json.loads(
                sh("slicebox", "--json", "create", "--project", project, "--ttl", "600").stdout
            )
            try:
                before = relay.relayed
                ran = sh("slicebox", "exec", box["id"], "--", "sh", "-c", "echo via tcp")
                assert ran.stdout == "via tcp\n"
                assert relay.relayed > before  # the exec's stream went through the relay
                # The deadline timer's expiry runs outside the agent, on the agent's engine.
                (timer,) = Deadlines(PystemdSystemd()).timers_of(box["id"])
                service = timer.unit.removesuffix(".timer") + ".service"
                command = sh("systemctl", "show", "-P", "ExecStart", service).stdout
                assert f"DOCKER_HOST={url}" in command, command
                checks = doctor_checks([], dict(os.environ))
                assert f"its engine: {url} (DOCKER_HOST)" in str(checks["agent"]["detail"])
            finally:
                sh("slicebox", "rm", box["id"])
            assert relay.accepted > 0
            gone = sh("docker", "ps", "-aq", "--filter", f"label=slicebox.sandbox={box['id']}")
            assert gone.stdout.strip() == ""


def test_doctor_follows_the_docker_context_the_config_names(tmp_path: Path) -> None:
    config = tmp_path / "docker"
    digest = hashlib.sha256(b"relayed").hexdigest()
    meta = config / "contexts" / "meta" / digest
    meta.mkdir(parents=True)
    sock = tmp_path / "relayed.sock"
    endpoints = {"docker": {"Host": f"unix://{sock}", "SkipTLSVerify": False}}
    (meta / "meta.json").write_text(json.dumps({"Name": "relayed", "Endpoints": endpoints}))
    (config / "config.json").write_text(json.dumps({"currentContext": "relayed"}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("DOCKER_")}
    with Relay.unix(sock) as relay:
        checks = doctor_checks([], {**env, "DOCKER_CONFIG": str(config)})
        docker = checks["docker"]
        assert docker["state"] == "ok", docker
        assert f"unix://{sock} (the Docker context 'relayed')" in str(docker["detail"])
        assert relay.accepted > 0
        # A context the config names but nobody made: refused with its code, not passed over.
        (config / "config.json").write_text(json.dumps({"currentContext": "nobody-made"}))
        refused = doctor_checks([], {**env, "DOCKER_CONFIG": str(config)})["docker"]
        assert refused["state"] == "fail"
        assert "'nobody-made'" in str(refused["detail"])


@contextmanager
def user_without_docker(name: str) -> Iterator[None]:
    """A user in no group: the system's Docker socket (root:docker 0660) is not theirs."""
    sh("userdel", name, check=False)
    sh("useradd", "--no-create-home", "--shell", "/bin/sh", name)
    try:
        yield
    finally:
        sh("userdel", name, check=False)


def test_doctor_finds_a_user_s_rootless_socket_past_the_system_s() -> None:
    with user_without_docker(USER):
        uid = pwd.getpwnam(USER).pw_uid
        # The user's runtime directory, as XDG_RUNTIME_DIR names it (not /run/user/<uid>:
        # logind owns that one, and may still hold it for an earlier test's user of this uid).
        runtime = Path(tempfile.mkdtemp(prefix="sbx-xdg-"))
        os.chown(runtime, uid, -1)
        try:
            with Relay.unix(runtime / "docker.sock", owner=uid) as relay:
                env = {"PATH": os.environ["PATH"], "XDG_RUNTIME_DIR": str(runtime)}
                docker = doctor_checks(["runuser", "-u", USER, "--"], env)["docker"]
                assert docker["state"] == "ok", docker
                detail = str(docker["detail"])
                assert f"unix://{runtime}/docker.sock (the rootless Docker socket)" in detail
                assert relay.accepted > 0
        finally:
            sh("rm", "-rf", str(runtime))
