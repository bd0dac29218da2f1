# shellcheck shell=bash
# Shared by tests/guest/{build,run,up,down}: where things live and how to reach a guest.
# The image and its kernel are cached outside the clone, keyed by a hash of what builds them,
# so a fresh clone on the same machine reuses them and a changed recipe rebuilds.

GUEST_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$GUEST_DIR/../.." && pwd)
CACHE_ROOT=${SLICEBOX_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/slicebox}
GUEST_SUITE=${SLICEBOX_GUEST_SUITE:-trixie}
GUEST_MEM=${SLICEBOX_GUEST_MEM:-4096}
GUEST_CPUS=${SLICEBOX_GUEST_CPUS:-2}
BOOT_TIMEOUT=${SLICEBOX_GUEST_BOOT_TIMEOUT:-300}

say() { printf '[guest %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { say "error: $*"; exit 2; }

# The image key: every file that decides what the image contains, plus the suite.
image_key() {
    { echo "$GUEST_SUITE"; cat "$GUEST_DIR/build" "$GUEST_DIR/packages.txt" "$GUEST_DIR"/image/*; } \
        | sha256sum | cut -c1-16
}

image_dir() { echo "$CACHE_ROOT/guest/$(image_key)"; }

# One running guest per checkout: its state lives under a directory named after the checkout.
run_dir() { echo "$CACHE_ROOT/run/$(echo "$REPO_ROOT" | sha256sum | cut -c1-12)"; }

# PVM (kvm_pvm) exposes /dev/kvm but cannot run a stock Debian kernel: use TCG there.
qemu_accel() {
    if [ -n "${SLICEBOX_GUEST_ACCEL:-}" ]; then
        echo "$SLICEBOX_GUEST_ACCEL"
    elif [ -w /dev/kvm ] && [ ! -d /sys/module/kvm_pvm ]; then
        echo kvm
    else
        echo tcg
    fi
}

qemu_accel_args() {
    case "$(qemu_accel)" in
        kvm) echo "-accel kvm -cpu host" ;;
        *) echo "-accel tcg,thread=multi -cpu Nehalem" ;;
    esac
}

free_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

ssh_opts() {
    local dir=$1
    echo "-i $(image_dir)/id_ed25519 -p $(cat "$dir/port") -o StrictHostKeyChecking=no" \
        "-o UserKnownHostsFile=/dev/null -o LogLevel=ERROR -o ConnectTimeout=5" \
        "-o ServerAliveInterval=15 -o ServerAliveCountMax=8"
}

guest_ssh() {
    local dir=$1; shift
    # shellcheck disable=SC2046
    ssh $(ssh_opts "$dir") root@127.0.0.1 "$@"
}

guest_alive() {
    local dir=$1
    [ -f "$dir/pid" ] && kill -0 "$(cat "$dir/pid")" 2>/dev/null
}

# The exit code of a command whose guest died under it: not a test failure (pytest uses 0-5,
# ssh 255) but a lost guest, worth one more run (sysexits' EX_TEMPFAIL).
GUEST_LOST=75

# Console lines that mean the guest's kernel is dead or dying. A soft-lockup report is not: an
# emulated CPU starved by a busy build machine trips that watchdog and the guest lives on.
PANIC_RE='Kernel panic|Oops:|BUG:'

# The console of DIR's guest from byte FROM on (default: all of it): prints the lines that show
# a dead kernel (the first ten, with the task and the instruction they name) and succeeds, or
# fails if there are none.
console_panic() {
    local dir=$1 from=${2:-0}
    tail -c +"$((from + 1))" "$dir/console.log" 2>/dev/null | tr -d '\r' | awk -v re="$PANIC_RE" '
        $0 ~ re && $0 !~ /soft lockup/ { found = 1 }
        found && ($0 ~ re || /RIP: |Comm: /) { print; if (++n == 10) exit }
        END { exit !found }'
}

console_size() { stat -c %s "$1/console.log" 2>/dev/null || echo 0; }

# A panicked guest answers nothing while ssh waits for its keep-alives to time out: end QEMU as
# soon as the console shows it. QEMU's exit closes the forwarded ssh connection at once.
watch_console() {
    local dir=$1 from=$2
    while guest_alive "$dir"; do
        console_panic "$dir" "$from" >/dev/null && { kill_qemu "$dir"; return 0; }
        sleep 1
    done
}

kill_qemu() {
    local dir=$1 pid i
    [ -f "$dir/pid" ] || return 0
    pid=$(cat "$dir/pid")
    kill "$pid" 2>/dev/null || true
    for i in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
    rm -f "$dir/pid"
}

# Did DIR's guest die since its console had FROM bytes? Says how (the console lines), ends QEMU.
guest_lost() {
    local dir=$1 from=${2:-0} lines
    if lines=$(console_panic "$dir" "$from"); then
        say "the guest's kernel died; its console:"
        sed 's/^/    /' <<< "$lines" >&2
        kill_qemu "$dir"
    elif ! guest_alive "$dir"; then
        say "QEMU exited"; show_logs "$dir"
    else
        return 1
    fi
}

# Run a command (an ssh session into DIR's guest) while watching the guest's console: a guest
# that dies under it ends it at once with the exit code GUEST_LOST, never a wait on time-outs.
under_watch() {
    local dir=$1 from watcher rc; shift
    from=$(console_size "$dir")
    watch_console "$dir" "$from" </dev/null >/dev/null 2>&1 8>&- 9>&- &
    watcher=$!
    "$@" && rc=0 || rc=$?
    kill "$watcher" 2>/dev/null || true
    wait "$watcher" 2>/dev/null || true
    if guest_lost "$dir" "$from"; then return "$GUEST_LOST"; fi
    return "$rc"
}

# Boot DISK (format FMT) as the guest recorded in DIR and wait until it is ready; a qcow2 DISK
# is made afresh over the image. A guest lost to the emulator (QEMU's TCG crashing early, the
# kernel panicking, see RIG.md) boots once more; anything else is a clear error, never a hang.
boot_guest() {
    local dir=$1 disk=$2 fmt=$3 attempt rc
    for attempt in 1 2; do
        [ "$fmt" = qcow2 ] && new_overlay "$disk"
        boot_once "$dir" "$disk" "$fmt" && wait_ready "$dir" && return 0 || rc=$?
        if [ "$rc" != "$GUEST_LOST" ]; then
            stop_qemu "$dir"; die "the guest booted but is not ready; logs in $dir"
        fi
        kill_qemu "$dir"  # it never answered, or it is dead: nothing to power off
        say "boot attempt $attempt lost the guest"
    done
    die "the guest did not boot; console above, logs in $dir"
}

new_overlay() {
    rm -f "$1"
    qemu-img create -q -f qcow2 -F raw -b "$(image_dir)/disk.img" "$1"
}

# Start QEMU and wait for ssh. Returns GUEST_LOST if the guest dies or never answers.
boot_once() {
    local dir=$1 disk=$2 fmt=$3 img port deadline
    img=$(image_dir)
    mkdir -p "$dir"
    port=$(free_port)
    echo "$port" > "$dir/port"
    : > "$dir/console.log"
    say "booting ($(qemu_accel), ${GUEST_CPUS} vCPU, ${GUEST_MEM} MB, ssh on 127.0.0.1:$port)"
    # panic=1 with -no-reboot: a panicked kernel ends QEMU instead of spinning on two host CPUs.
    # shellcheck disable=SC2046
    qemu-system-x86_64 $(qemu_accel_args) -m "$GUEST_MEM" -smp "$GUEST_CPUS" \
        -display none -monitor none -serial "file:$dir/console.log" -D "$dir/qemu.log" \
        -daemonize -pidfile "$dir/pid" -no-reboot -rtc base=utc \
        -kernel "$img/vmlinuz" -initrd "$img/initrd.img" \
        -append "root=/dev/vda rw console=ttyS0 systemd.unified_cgroup_hierarchy=1 apparmor=0 panic=1 mitigations=off quiet" \
        -drive "file=$disk,format=$fmt,if=virtio,cache=${GUEST_DISK_CACHE:-unsafe},discard=unmap" \
        -netdev "user,id=n0,hostfwd=tcp:127.0.0.1:$port-:22" -device virtio-net-pci,netdev=n0 \
        -virtfs "local,path=$REPO_ROOT,mount_tag=src,security_model=passthrough,id=src" \
        8>&- 9>&- || return "$GUEST_LOST"  # QEMU outlives us: it must not hold our locks
    deadline=$((SECONDS + BOOT_TIMEOUT))
    until guest_ssh "$dir" true </dev/null 2>/dev/null; do
        guest_lost "$dir" && return "$GUEST_LOST"
        if grep -q "KVM internal error" "$dir/qemu.log" 2>/dev/null; then
            show_logs "$dir"; kill_qemu "$dir"
            die "KVM cannot run this guest; set SLICEBOX_GUEST_ACCEL=tcg"
        fi
        if [ $SECONDS -ge $deadline ]; then
            say "no ssh after ${BOOT_TIMEOUT}s"; show_logs "$dir"; return "$GUEST_LOST"
        fi
        sleep 2
    done
    say "ssh is up after $((SECONDS + BOOT_TIMEOUT - deadline))s"
}

show_logs() {
    local dir=$1
    say "console tail:"; tail -n 30 "$dir/console.log" >&2 2>/dev/null || true
    [ -s "$dir/qemu.log" ] && { say "qemu log:"; tail -n 10 "$dir/qemu.log" >&2; }
    return 0
}

# Wait until systemd has finished booting and dockerd answers: 0 when ready, GUEST_LOST if the
# guest died meanwhile, 1 if it lives but is not ready (a broken image, not a flake).
wait_ready() {
    local dir=$1 rc
    under_watch "$dir" guest_ssh "$dir" </dev/null 'systemctl is-system-running --wait >/dev/null 2>&1;
        for i in $(seq 120); do docker info >/dev/null 2>&1 && exit 0; sleep 1; done;
        echo "dockerd did not answer" >&2; systemctl --no-pager status docker >&2; exit 1' \
        && return 0 || rc=$?
    [ "$rc" = "$GUEST_LOST" ] || show_logs "$dir"
    return "$rc"
}

stop_qemu() {
    local dir=$1 pid i
    [ -f "$dir/pid" ] || return 0
    pid=$(cat "$dir/pid")
    # A dead kernel cannot power off: do not wait for it.
    console_panic "$dir" >/dev/null && { kill_qemu "$dir"; return 0; }
    if kill -0 "$pid" 2>/dev/null; then
        guest_ssh "$dir" 'systemctl poweroff' </dev/null >/dev/null 2>&1 || true
        for i in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
        kill -0 "$pid" 2>/dev/null && { say "guest did not power off; killing QEMU"; kill_qemu "$dir"; }
    fi
    rm -f "$dir/pid"
}

# Console scripts of the checkout, as an install would make them (agent/ is already on the path).
prepare_guest() {
    guest_ssh "$1" python3 - <<'PY'
import tomllib, pathlib
scripts = tomllib.loads(pathlib.Path("/src/pyproject.toml").read_text())["project"]["scripts"]
for name, target in scripts.items():
    module, func = target.split(":")
    path = pathlib.Path("/usr/local/bin") / name
    path.write_text(f"#!/usr/bin/python3\nimport sys\nfrom {module} import {func}\nsys.exit({func}())\n")
    path.chmod(0o755)
PY
}

start_guest() {
    local dir=$1
    boot_guest "$dir" "$dir/overlay.qcow2" qcow2
    prepare_guest "$dir" || die "could not install the checkout's scripts in the guest"
    say "guest ready"
}

stop_guest() {
    local dir=$1
    stop_qemu "$dir"
    rm -f "$dir/overlay.qcow2" "$dir/port"
}

# Wait up to SECONDS for ssh to answer a running guest.
wait_ssh() {
    local dir=$1 deadline=$((SECONDS + $2))
    until guest_ssh "$dir" true </dev/null 2>/dev/null; do
        [ $SECONDS -ge "$deadline" ] && return 1
        guest_alive "$dir" || return 1
        sleep 2
    done
}
