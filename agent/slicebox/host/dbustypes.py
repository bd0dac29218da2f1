"""How slicebox's systemd calls are typed for pystemd's bus: the D-Bus signatures of the unit
properties it sets that pystemd's table lacks, and the marshalling of a call's arguments (unit
properties as ``a(sv)``, a transient unit's auxiliary units as ``a(sa(sv))``). pystemd is
imported when a call is made, not with this module."""

from collections.abc import Sequence
from typing import Any

from slicebox.model.limits import Property


def known_signatures() -> None:
    """Teach pystemd the D-Bus types of the timer properties its table lacks."""
    from pystemd.systemd1.unit_signatures import KNOWN_UNIT_SIGNATURES

    for name, signature in SIGNATURES.items():
        KNOWN_UNIT_SIGNATURES.setdefault(name, signature)


# The D-Bus types of the unit properties slicebox sets that pystemd's table lacks (systemd's
# own, from org.freedesktop.systemd1(5)).
SIGNATURES = {
    b"AccuracyUSec": b"t",
    b"CapabilityBoundingSet": b"t",
    b"AmbientCapabilities": b"t",
    b"RestrictNamespaces": b"t",
    b"RestrictAddressFamilies": b"(bas)",
    b"SystemCallArchitectures": b"as",
    b"SystemCallErrorNumber": b"i",
    b"ProtectHome": b"s",
    b"ProtectProc": b"s",
    b"ProcSubset": b"s",
    b"PrivateTmp": b"b",
    b"PrivateDevices": b"b",
    b"PrivateIPC": b"b",
    b"PrivateUsers": b"b",
    b"NoNewPrivileges": b"b",
    b"LockPersonality": b"b",
    b"ProtectKernelTunables": b"b",
    b"ProtectKernelModules": b"b",
    b"ProtectKernelLogs": b"b",
    b"ProtectControlGroups": b"b",
    b"ProtectClock": b"b",
    b"ProtectHostname": b"b",
    b"RestrictRealtime": b"b",
    b"RestrictSUIDSGID": b"b",
    b"RemoveIPC": b"b",
    b"RemainAfterExit": b"b",
    b"KillMode": b"s",
    b"KillSignal": b"i",
    b"OOMPolicy": b"s",
    b"DevicePolicy": b"s",
    b"KeyringMode": b"s",
    b"UMask": b"u",
    b"RuntimeDirectoryMode": b"u",
    b"RuntimeDirectoryPreserve": b"s",
    b"IPAddressDeny": b"a(iayu)",
    b"IPAddressAllow": b"a(iayu)",
    b"PrivatePIDs": b"s",
    b"OOMScoreAdjust": b"i",
    b"PIDFDs": b"ah",
    b"MemorySwapMax": b"t",
    b"Type": b"s",
}


def named(properties: Sequence[Property]) -> dict[bytes, Any]:
    return {name.encode(): value for name, value in properties}


def typed(signature: bytes, *values: Any) -> list[Any]:
    """Arguments of a D-Bus call, each paired with its type as pystemd's bus takes them."""
    from pystemd.dbuslib import apply_signature

    return list(apply_signature(signature, list(values)))


def array(properties: dict[bytes, Any]) -> list[Any]:
    """Unit properties as an ``a(sv)`` argument, each value typed by systemd's property
    table (pystemd's)."""
    from pystemd.systemd1.unit_signatures import signature_array

    return list(signature_array(properties))


def aux(units: list[tuple[bytes, dict[bytes, Any]]]) -> list[Any]:
    """The auxiliary units of a ``StartTransientUnit``, an ``a(sa(sv))`` argument: the
    encoding pystemd's own ``StartTransientUnit`` writes."""
    args: list[Any] = [(ord("a"), b"(sa(sv))")]
    for name, properties in units:
        args += [(ord("r"), b"sa(sv)"), *typed(b"s", name), *array(properties), (-1, None)]
    return [*args, (-1, None)]
