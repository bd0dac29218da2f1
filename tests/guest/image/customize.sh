#!/bin/bash
# Runs on the build machine with the guest's root file system as $1 (mmdebstrap customize hook).
# Environment: KEY_PUB (the rig's ssh public key), WHEELHOUSE (image/wheels.txt's wheels).
set -euo pipefail
root=$1

echo slicebox-guest > "$root/etc/hostname"
printf '127.0.0.1 localhost\n127.0.1.1 slicebox-guest\n' > "$root/etc/hosts"
cat > "$root/etc/fstab" <<FSTAB
/dev/vda / ext4 rw,discard,errors=remount-ro 0 1
src /src 9p trans=virtio,version=9p2000.L,msize=262144,cache=none,nofail 0 0
FSTAB
mkdir -p "$root/src"

# Networking: DHCP from QEMU's user-mode network.
cat > "$root/etc/systemd/network/80-guest.network" <<NET
[Match]
Name=en* eth*
[Network]
DHCP=yes
NET
chroot "$root" systemctl enable systemd-networkd systemd-resolved ssh docker

# ssh: key only, root allowed (this guest is a test host reachable only from 127.0.0.1).
install -d -m 700 "$root/root/.ssh"
echo "$KEY_PUB" > "$root/root/.ssh/authorized_keys"
chmod 600 "$root/root/.ssh/authorized_keys"
printf 'UseDNS no\nPermitRootLogin prohibit-password\n' > "$root/etc/ssh/sshd_config.d/guest.conf"

# As the README advises a Podman host: an exec session started through Podman's API keeps its
# monitor (conmon) for exit_command_delay after the command ends (300 s by default, so that a
# client can still inspect it, as Docker allows), in the sandbox's project slice, which then
# cannot be collected. slicebox inspects an exec at once.
install -d "$root/etc/containers/containers.conf.d"
printf '[engine]\nexit_command_delay = 10\n' \
    > "$root/etc/containers/containers.conf.d/50-slicebox.conf"

# Podman's API socket only when a test starts it: nothing of Podman runs at boot.
chroot "$root" systemctl disable podman.socket podman.service podman-restart.service \
    podman-auto-update.timer podman-clean-transient.service 2>/dev/null || true

# Debian's Prometheus server, for the metrics test (issue 41), which starts it with its own
# config, token and storage: nothing of it runs at boot (nor the node exporter, if pulled in).
# Debian's registry likewise, for the pull test (issue 46), started on loopback by the test.
# One call each: systemctl disables none of its units when one of them is not installed.
for unit in prometheus.service prometheus-node-exporter.service docker-registry.service; do
    chroot "$root" systemctl disable "$unit" >/dev/null 2>&1 || true
done

# Docker with the systemd cgroup driver (the product's requirement), no userland proxy.
install -d "$root/etc/docker"
cat > "$root/etc/docker/daemon.json" <<JSON
{"exec-opts": ["native.cgroupdriver=systemd"], "userland-proxy": false, "log-driver": "local"}
JSON

# Nothing in the background that competes with tests for two emulated CPUs.
for unit in apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer \
            dpkg-db-backup.timer man-db.timer systemd-tmpfiles-clean.timer; do
    chroot "$root" systemctl mask "$unit" >/dev/null 2>&1 || true
done
ln -sf /dev/null "$root/etc/systemd/system/serial-getty@ttyS0.service"

# Under QEMU's TCG the first CPU-limited cgroup can kill the kernel ("Oops: int3"): switch the
# kernel's CPU-bandwidth key once, early, with one CPU online (see the script for why).
install -m 755 "$(dirname "$0")/rig-cpu-bandwidth" "$root/usr/local/sbin/rig-cpu-bandwidth"
cat > "$root/etc/systemd/system/rig-cpu-bandwidth.service" <<UNIT
[Unit]
Description=Switch the CPU-bandwidth static key with one CPU online (QEMU TCG patching race)
DefaultDependencies=no
Conflicts=shutdown.target
Before=sysinit.target shutdown.target docker.service
[Service]
Type=oneshot
RemainAfterExit=yes
Delegate=yes
ExecStart=/usr/local/sbin/rig-cpu-bandwidth
[Install]
WantedBy=sysinit.target
UNIT
chroot "$root" systemctl enable rig-cpu-bandwidth.service

# runc from a sealed in-memory copy, so it does not copy itself at every exec (under TCG that
# copy costs about 0.6 s of guest CPU per exec; see the script for why).
install -m 755 "$(dirname "$0")/rig-sealed-runc" "$root/usr/local/sbin/rig-sealed-runc"
ln -sfn /run/rig-runc "$root/usr/local/sbin/runc"  # the copy while it is held
cat > "$root/etc/systemd/system/rig-sealed-runc.service" <<UNIT
[Unit]
Description=Hold a sealed in-memory copy of runc (runc's memfd-bind, for QEMU TCG)
Before=containerd.service docker.service
[Service]
Type=notify
ExecStart=/usr/local/sbin/rig-sealed-runc
[Install]
WantedBy=multi-user.target
UNIT
chroot "$root" systemctl enable rig-sealed-runc.service

# The wheels a list names, unpacked into a site directory as pip would install them (a wheel
# is a zip).
unpack_wheels() {
    local list=$1 site=$2 spec name version wheel
    mkdir -p "$site"
    while read -r spec; do
        case $spec in ''|'#'*) continue ;; esac
        name=${spec%%==*}; version=${spec#*==}
        wheel=$(ls "$WHEELHOUSE"/"${name//-/_}"-"$version"-*.whl | head -n1)
        python3 -m zipfile -e "$wheel" "$site"
    done < "$list"
    chmod -R a+rX "$site"
}

# image/wheels.txt, for the agent's own Python.
site=$(ls -d "$root"/usr/lib/python3.*/ | head -n1)
unpack_wheels "$(dirname "$0")/wheels.txt" "$root/usr/local/lib/$(basename "$site")/dist-packages"

# The MCP venv that `slicebox mcp` runs when Debian's python cannot import the SDK (issue 42,
# docs/mcp.md): it sees Debian's packages and the checkout (--system-site-packages), and its
# own site-packages, first on its path, holds image/mcp-wheels.txt (the SDK and a newer
# pydantic), which therefore shadow nothing outside it. No pip in it: the wheels are unpacked.
chroot "$root" python3 -m venv --system-site-packages --without-pip /opt/slicebox-mcp
unpack_wheels "$(dirname "$0")/mcp-wheels.txt" \
    "$(ls -d "$root"/opt/slicebox-mcp/lib/python3.*/site-packages)"
chmod -R a+rX "$root/opt/slicebox-mcp"

# The checkout's agent/ is importable as the installed project (the rig adds the scripts).
py=$(ls -d "$root"/usr/lib/python3/dist-packages)
echo /src/agent > "$py/slicebox-checkout.pth"

# A small initramfs: only what boots a virtio disk with ext4 and mounts 9p.
printf 'virtio_pci\nvirtio_blk\nvirtio_net\next4\n9p\n9pnet_virtio\n' \
    > "$root/etc/initramfs-tools/modules"
echo MODULES=list > "$root/etc/initramfs-tools/conf.d/slicebox-guest"
chroot "$root" update-initramfs -u -k all >/dev/null

# Clean caches: they would only make the image bigger.
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
