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

# One running guest per checkout and lane: its state lives under a directory named after the
# checkout, and after the lane (SLICEBOX_GUEST_LANE) for each of tests/run-all's lanes.
run_dir() {
    local lane=${SLICEBOX_GUEST_LANE:-}
    [[ $lane =~ ^[a-z0-9]*$ ]] || die "SLICEBOX_GUEST_LANE must be letters and digits: $lane"
    echo "$CACHE_ROOT/run/$(echo "$REPO_ROOT" | sha256sum | cut -c1-12)${lane:+-$lane}"
}

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
    [ -f "$dir/pid" ] && pid_alive "$(cat "$dir/pid")"
}

# A QEMU that exited is reaped by PID 1 (it daemonized), here up to a second later: a zombie is
# no QEMU.
pid_alive() {
    local stat
    kill -0 "$1" 2>/dev/null && read -r stat < "/proc/$1/stat" 2>/dev/null || return 1
    stat=${stat##*) }; [ "${stat%% *}" != Z ]
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
    for i in $(seq 50); do pid_alive "$pid" || break; sleep 0.1; done
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
    watch_console "$dir" "$from" </dev/null >/dev/null 2>&1 7>&- 8>&- 9>&- &
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

# The emulated machine, one argument a line: everything a saved state must find again when it is
# resumed (devices, memory, CPUs, kernel). {image}, {disk}, {fmt}, {port} and {src} (the
# checkout) are filled in by qemu_start; left as they are, the lines are part of the snapshot's
# key, which therefore fits every checkout. vmgenid tells the
# kernel it was resumed (a new generation id), which reseeds its random numbers at once.
machine_args() {
    # shellcheck disable=SC2046
    printf '%s\n' $(qemu_accel_args) -m "$GUEST_MEM" -smp "$GUEST_CPUS" -no-reboot -rtc base=utc \
        -kernel '{image}/vmlinuz' -initrd '{image}/initrd.img' \
        -append "root=/dev/vda rw console=ttyS0 systemd.unified_cgroup_hierarchy=1 apparmor=0 panic=1 mitigations=off quiet" \
        -drive "file={disk},format={fmt},if=virtio,cache=${GUEST_DISK_CACHE:-unsafe},discard=unmap" \
        -netdev 'user,id=n0,hostfwd=tcp:127.0.0.1:{port}-:22' -device virtio-net-pci,netdev=n0 \
        -virtfs 'local,path={src},mount_tag=src,security_model=passthrough,id=src' \
        -device vmgenid,guid=auto
}

# Start QEMU in the background as DIR's guest on DISK (format FMT), with EXTRA arguments (an
# -incoming state); the ssh port is new each time. QMP on DIR/qmp.sock saves and resumes.
qemu_start() {
    local dir=$1 disk=$2 fmt=$3 img port arg args=(); shift 3
    img=$(image_dir)
    mkdir -p "$dir"
    port=$(free_port)
    echo "$port" > "$dir/port"
    : > "$dir/console.log"; : > "$dir/qemu.log"
    rm -f "$dir/qmp.sock" "$dir/resumed"
    while IFS= read -r arg; do
        arg=${arg//\{image\}/$img}; arg=${arg//\{disk\}/$disk}
        arg=${arg//\{fmt\}/$fmt}; arg=${arg//\{port\}/$port}; arg=${arg//\{src\}/$REPO_ROOT}
        args+=("$arg")
    done < <(machine_args)
    # panic=1 with -no-reboot: a panicked kernel ends QEMU instead of spinning on two host CPUs.
    qemu-system-x86_64 "${args[@]}" "$@" \
        -display none -monitor none -serial "file:$dir/console.log" -D "$dir/qemu.log" \
        -qmp "unix:$dir/qmp.sock,server=on,wait=off" -daemonize -pidfile "$dir/pid" \
        7>&- 8>&- 9>&-  # QEMU outlives us: it must not hold our locks
}

# Start QEMU and wait for ssh. Returns GUEST_LOST if the guest dies or never answers.
boot_once() {
    local dir=$1 disk=$2 fmt=$3 deadline
    qemu_start "$dir" "$disk" "$fmt" || return "$GUEST_LOST"
    say "booting ($(qemu_accel), ${GUEST_CPUS} vCPU, ${GUEST_MEM} MB, ssh on 127.0.0.1:$(cat "$dir/port"))"
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
    [ -f "$dir/resumed" ] && say "(a guest resumed from a snapshot: its console has no boot messages)"
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
        for i in $(seq 60); do pid_alive "$pid" || break; sleep 1; done
        pid_alive "$pid" && { say "guest did not power off; killing QEMU"; kill_qemu "$dir"; }
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

# ---- Snapshots: boot once, resume after ----
# A cold boot under emulation takes 40-110 s to a ready dockerd (the more, the busier the build
# machine); resuming the saved state of a booted, idle guest takes 6-12 s. The snapshot lives beside the image it was booted
# from (a new image gets a new one), is keyed by what must match at resume (snapshot_key), and
# is made by the first cold boot that finds none. SLICEBOX_GUEST_SNAPSHOT=0 turns it off.

snapshot_dir() { echo "$(image_dir)/snapshot"; }

snapshots_on() { [ "${SLICEBOX_GUEST_SNAPSHOT:-1}" != 0 ]; }

# What a saved state needs to find again: the same QEMU, memory, CPUs, accelerator and devices.
snapshot_key() {
    echo "qemu: $(qemu-system-x86_64 --version 2>/dev/null | head -n1)"
    echo "GUEST_MEM: $GUEST_MEM"
    echo "GUEST_CPUS: $GUEST_CPUS"
    echo "accel: $(qemu_accel)"
    echo "machine: $(machine_args | paste -sd ' ')"
}

# Succeeds if SNAP can be resumed; else prints why ("none" when there is no snapshot at all).
snapshot_usable() {
    local snap=$1 file line
    [ -d "$snap" ] || { echo none; return 1; }
    for file in key state disk.qcow2; do
        [ -s "$snap/$file" ] || { echo "its $file is missing"; return 1; }
    done
    snapshot_key | cmp -s "$snap/key" - && return 0
    # Not the pipeline's status: diff fails when the keys differ, and up runs with pipefail.
    line=$(diff "$snap/key" <(snapshot_key) | grep -m1 '^>' || true)
    line=${line#> }; line=${line%%:*}; echo "saved for another ${line:-machine}"; return 1
}

# A path as one word of /bin/sh (QEMU's exec: migration URIs go through it).
sh_quote() { printf "'%s'" "${1//\'/\'\\\'\'}"; }

# Remove the broken snapshot SNAP, unless it is no longer the one that failed (a new one, whose
# key file is another) or someone is saving or resuming one (its lock is held). Guests already
# resumed from it keep their open files.
drop_snapshot() {
    local snap=$1 id=$2
    ( flock -n 7 || exit 0
      [ "$(stat -c %i "$snap/key" 2>/dev/null)" = "$id" ] && rm -rf "$snap"
    ) 7> "$snap.lock"
}

# Resume DIR's guest from the image's snapshot: succeeds when it runs, ready, /src mounted.
# Otherwise exactly one line says why, the QEMU started for it is gone, a broken snapshot is
# removed, and it fails: the caller cold-boots.
resume_guest() {
    local dir=$1 snap why="" id
    snapshots_on || { say "snapshots are off (SLICEBOX_GUEST_SNAPSHOT=0): cold boot"; return 1; }
    snap=$(snapshot_dir)
    mkdir -p "$(dirname "$snap")"
    id=$(stat -c %i "$snap/key" 2>/dev/null)
    if ! why=$(snapshot_usable "$snap"); then
        if [ "$why" = none ]; then
            say "no snapshot of this guest yet: cold boot, then saving one"
        else
            say "snapshot unusable ($why): cold boot"; drop_snapshot "$snap" "$id"
        fi
        return 1
    fi
    # Shared while QEMU opens the snapshot's files: nobody replaces them under it.
    exec 7> "$snap.lock"
    if ! flock -s -n 7; then
        exec 7>&-; say "another checkout is saving a snapshot: cold boot"; return 1
    fi
    resume_once "$dir" "$snap" && return 0  # sets why (bash's locals are seen by callees)
    exec 7>&-
    kill_qemu "$dir"; rm -f "$dir/overlay.qcow2" "$dir/resumed"
    say "snapshot unusable ($why): cold boot"
    drop_snapshot "$snap" "$id"
    return 1
}

# resume_guest's work; on failure sets why, of resume_guest.
resume_once() {
    local dir=$1 snap=$2 err
    rm -f "$dir/overlay.qcow2"
    if ! err=$(qemu-img create -q -f qcow2 -F qcow2 -b "$snap/disk.qcow2" \
                   "$dir/overlay.qcow2" 2>&1); then
        why="no overlay over its disk: ${err##*: }"; return 1
    fi
    if ! qemu_start "$dir" "$dir/overlay.qcow2" qcow2 \
            -incoming "exec:cat $(sh_quote "$snap/state")" >/dev/null 2>&1 \
        || ! err=$(python3 "$GUEST_DIR/qmp.py" "$dir/qmp.sock" resume 60 2>&1); then
        # A QEMU that closed its socket is ending: give it a moment to be gone.
        for _ in $(seq 20); do guest_alive "$dir" || break; sleep 0.1; done
        if guest_alive "$dir"; then why="the state did not load: $err"; return 1; fi
        err=$(tail -n 1 "$dir/qemu.log" 2>/dev/null); err=${err#qemu-system-x86_64: }
        why="QEMU exited while loading the state${err:+: $err}"
        return 1
    fi
    exec 7>&-  # the state is read and the disk open: the snapshot may be replaced now
    touch "$dir/resumed"
    resync_guest "$dir"
}

# What a resumed guest runs first (as root, through ssh): it says when it listens, then reads
# this machine's time and random bytes from its standard input, sets its clock (the snapshot's
# is minutes or days old) and feeds and reseeds its kernel's random generator (every guest
# resumed from one snapshot starts with the same state; vmgenid reseeds it too, this makes sure).
# Then /src (unmounted for the save) mounts again, and systemd and dockerd must answer.
RESYNC_PY='
import fcntl, struct, sys, time
print("listening", flush=True)
now, seed = sys.stdin.readline().split()
time.clock_settime(time.CLOCK_REALTIME, float(now))
seed = bytes.fromhex(seed)
with open("/dev/random", "wb") as rnd:
    RNDADDENTROPY, RNDRESEEDCRNG = 0x40085203, 0x5207
    fcntl.ioctl(rnd, RNDADDENTROPY, struct.pack("ii", 8 * len(seed), len(seed)) + seed)
    fcntl.ioctl(rnd, RNDRESEEDCRNG)
'
resync_script() {
    printf '%s' "python3 -c $(printf '%q' "$RESYNC_PY") \
            || { echo 'clock and entropy not set'; exit 3; }
        mountpoint -q /src || mount /src 2>&1 || { echo '/src did not mount'; exit 4; }
        systemctl is-system-running --wait >/dev/null 2>&1
        for i in \$(seq 60); do docker info >/dev/null 2>&1 && exit 0; sleep 1; done
        echo 'dockerd did not answer'; exit 5"
}

# Run resync_script in DIR's resumed guest, retrying ssh for up to 60 s; on failure sets why.
# The time is written the moment the guest listens, so its clock is off by one pipe write, not
# by an ssh login under emulation.
resync_guest() {
    local dir=$1 deadline=$((SECONDS + 60)) fifo=$1/resync w r line out pid rc
    while :; do
        rm -f "$fifo.in" "$fifo.out"; mkfifo "$fifo.in" "$fifo.out"
        # shellcheck disable=SC2046  # ssh itself is the job, so that kill ends it
        ( exec ssh $(ssh_opts "$dir") root@127.0.0.1 "$(resync_script)" ) \
            < "$fifo.in" > "$fifo.out" 2>&1 7>&- &
        pid=$!
        exec {w}> "$fifo.in" {r}< "$fifo.out"
        if read -r -t 60 line <&"$r" && [ "$line" = listening ]; then
            # In a subshell: should the guest be gone, SIGPIPE ends that, not us.
            ( printf '%s %s\n' "$(now_real)" \
                  "$(od -An -N64 -tx1 /dev/urandom | tr -d ' \n')" >&"$w" ) 2>/dev/null
        else
            kill "$pid" 2>/dev/null  # a guest that does not answer: no wait on ssh's keep-alives
        fi
        exec {w}>&-
        out=$(cat <&"$r"); exec {r}<&-
        wait "$pid" && rc=0 || rc=$?
        rm -f "$fifo.in" "$fifo.out"
        [ "$rc" = 0 ] && return 0
        console_panic "$dir" >/dev/null && { why="the guest's kernel died after resuming"; return 1; }
        guest_alive "$dir" || { why="QEMU exited after resuming"; return 1; }
        if [ "$rc" != 255 ]; then
            why=${out##*$'\n'}; why=${why:-"resync ended with $rc"}; return 1
        fi
        [ $SECONDS -ge "$deadline" ] && { why="no ssh 60s after resuming"; return 1; }
        sleep 0.5
    done
}

# Save DIR's freshly booted, idle guest as the image's snapshot; QEMU ends with it. Returns 0
# when saved (no guest runs any more), 1 when not saved but the guest runs on as it was, 2 when
# not saved and the guest is gone.
save_snapshot() {
    local dir=$1 snap part err pid start=$SECONDS
    snap=$(snapshot_dir); part="$snap.partial"
    # One saver at a time, never under a guest resuming: the others go on without.
    exec 7> "$snap.lock"
    if ! flock -n 7; then
        exec 7>&-; say "another checkout is saving or resuming a snapshot: not saving one"; return 1
    fi
    if snapshot_usable "$snap" >/dev/null; then exec 7>&-; return 1; fi  # saved meanwhile
    say "saving a snapshot of the booted guest for the next start"
    rm -rf "$part"; mkdir -p "$part"
    # QEMU 7.2 refuses to migrate while the 9p export is mounted (the fstab's nofail mount).
    if ! err=$(guest_ssh "$dir" 'umount /src && sync' </dev/null 2>&1); then
        exec 7>&-; rm -rf "$part"; say "snapshot not saved (/src did not unmount: $err)"; return 1
    fi
    if ! err=$(python3 "$GUEST_DIR/qmp.py" "$dir/qmp.sock" save \
                   "exec:cat > $(sh_quote "$part/state")" 600 2>&1); then
        exec 7>&-; rm -rf "$part"; say "snapshot not saved ($err)"
        # The guest was stopped for the save: let it run on as it was.
        python3 "$GUEST_DIR/qmp.py" "$dir/qmp.sock" cont >/dev/null 2>&1 \
            && guest_ssh "$dir" mount /src </dev/null >/dev/null 2>&1 && return 1
        kill_qemu "$dir"; return 2
    fi
    # A clean quit writes out the overlay's metadata: only then is it the snapshot's disk.
    pid=$(cat "$dir/pid")
    python3 "$GUEST_DIR/qmp.py" "$dir/qmp.sock" quit >/dev/null 2>&1
    for _ in $(seq 100); do pid_alive "$pid" || break; sleep 0.1; done
    if pid_alive "$pid"; then
        exec 7>&-; rm -rf "$part"; kill_qemu "$dir"; say "snapshot not saved (QEMU did not quit)"
        return 2
    fi
    rm -f "$dir/pid"
    # The key last, the directory renamed at the end: a half-made snapshot is never resumed.
    if ! { mv "$dir/overlay.qcow2" "$part/disk.qcow2" \
           && chmod a-w "$part/disk.qcow2" "$part/state" && snapshot_key > "$part/key" \
           && rm -rf "$snap" && mv "$part" "$snap"; }; then
        exec 7>&-; rm -rf "$part"; say "snapshot not saved (could not move it in place)"; return 2
    fi
    exec 7>&-
    say "snapshot saved in $((SECONDS - start))s ($(du -sh "$snap" | cut -f1), $snap)"
}

# The time of day in seconds, to the microsecond (a locale may write a decimal comma).
now_real() { echo "${EPOCHREALTIME/,/.}"; }

# Seconds since a now_real, to a tenth.
since() { echo "$(now_real) $1" | awk '{ printf "%.1f", $1 - $2 }'; }

# A guest for DIR: resumed from the snapshot when one is usable, else cold-booted, its snapshot
# saved and resumed at once (which proves it). DIR/started says which ("resume" or "boot") and
# the seconds to a ready guest, for tests/run-all's account of where the time went.
start_guest() {
    local dir=$1 start how secs rc
    start=$(now_real)
    rm -f "$dir/started"
    if resume_guest "$dir"; then
        how=resume; secs=$(since "$start")
        say "resumed from the snapshot in ${secs}s (ssh, dockerd, /src)"
    else
        boot_guest "$dir" "$dir/overlay.qcow2" qcow2
        how=boot; secs=$(since "$start")
        say "cold boot in ${secs}s"
        if snapshots_on; then
            save_snapshot "$dir" && rc=0 || rc=$?
            # A snapshot that does not resume at once is dropped: boot once more, save none.
            case $rc in
                0) resume_guest "$dir" || boot_guest "$dir" "$dir/overlay.qcow2" qcow2 ;;
                2) boot_guest "$dir" "$dir/overlay.qcow2" qcow2 ;;
            esac
        fi
    fi
    prepare_guest "$dir" || die "could not install the checkout's scripts in the guest"
    echo "$how $secs" > "$dir/started"
    [ $how = resume ] && how=resumed || how="cold boot"
    say "guest ready ($how ${secs}s, in all $(since "$start")s)"
}

stop_guest() {
    local dir=$1
    stop_qemu "$dir"
    rm -f "$dir/overlay.qcow2" "$dir/port" "$dir/qmp.sock" "$dir/resumed"
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
