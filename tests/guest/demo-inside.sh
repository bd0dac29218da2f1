#!/bin/bash
# The main job, inside the real-host guest: install the checkout's units into systemd, let a
# first CLI call start the agent through its socket, and use a sandbox as an ordinary user.
set -euo pipefail
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
cleanup() {
    slicebox rm "${box:-none}" >/dev/null 2>&1 || true
    systemctl stop slicebox.service slicebox.socket 2>/dev/null || true
    rm -rf /run/systemd/system/slicebox.* /etc/slicebox; systemctl daemon-reload
    userdel demo 2>/dev/null || true
}
trap cleanup EXIT
task="demo-$(date +%s)"

getent group slicebox >/dev/null || groupadd --system slicebox
id demo >/dev/null 2>&1 || useradd --no-create-home --groups slicebox demo
mkdir -p /etc/slicebox /run/systemd/system/slicebox.service.d
echo 'default_image = "slicebox-test/busybox:latest"' > /etc/slicebox/config.toml
cp /src/units/slicebox.service /src/units/slicebox.socket /run/systemd/system/
printf '[Service]\nExecStart=\nExecStart=/usr/local/bin/sliceboxd\n' \
    > /run/systemd/system/slicebox.service.d/checkout.conf
systemctl daemon-reload
systemctl start slicebox.socket
demo() { runuser -u demo -- slicebox "$@"; }

say "slicebox doctor (the first call starts sliceboxd through slicebox.socket)"
demo doctor
say "a one-shot run: create, exec, destroy"
demo run --project hello -- sh -c 'echo "hello from $(hostname), pid $$"; id'
say "a sandbox of user demo, project hello, 128MB"
box=$(demo create --project hello --memory 128MB --root-task "$task")
demo ps
cat "/proc/$(docker inspect -f '{{.State.Pid}}' "$(docker ps -qf label=slicebox.sandbox_id="$box")")/cgroup"
demo exec --timeout 120 "$box" -- sh -c 'x=$(head -c 8000000 /dev/zero | tr "\0" x); echo holding ${#x} bytes; sleep 1'
say "its ResourceUsage, from cgroup v2"
demo usage "$box"
say "the level tree"
demo top --count 1
say "its deadline is a systemd timer, enforced even while the agent is down; extend it"
demo extend "$box" 900
systemctl list-timers --no-pager 'slicebox-ttl-*'
say "what the reaper would do now (root only)"
slicebox reap --dry-run
say "destroy: the final usage"
demo rm "$box"
say "the task's story in the journal"
journalctl --no-pager -o cat SLICEBOX_ROOT_TASK_ID="$task"
