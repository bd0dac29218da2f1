"""The OS boundaries, each behind a small typed interface: systemd over D-Bus, cgroupfs,
netlink, the journal, peer credentials, the listening socket. Imports only ``model``."""
