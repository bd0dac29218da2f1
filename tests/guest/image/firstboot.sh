#!/bin/sh
# Runs once inside the freshly built guest, before the image is marked ready: things that need
# a running dockerd. Images are made locally because the guest reaches no image registry.
#
# Three images from one busybox rootfs:
#   slicebox-test/busybox:latest  with a world-writable /workspace baked in
#   slicebox-test/stock:latest    without it, like a stock image (alpine:3.19): the default
#                                 exec cwd must work on such an image too
#   slicebox-test/git:latest      the busybox one plus the guest's git (clone, commit and push
#                                 over plain HTTP as a uid with no passwd entry), for git
#                                 workspaces with credentials
set -eu
work=$(mktemp -d)
mkdir -p "$work/bin" "$work/tmp" "$work/etc"
cp /bin/busybox "$work/bin/busybox"
for applet in $(/bin/busybox --list); do
    [ "$applet" = busybox ] || ln -s busybox "$work/bin/$applet"
done
chmod 1777 "$work/tmp"
printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n' > "$work/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' > "$work/etc/group"
tar -C "$work" -c . | docker import \
    -c 'ENV PATH=/bin' -c 'CMD ["/bin/sh"]' - slicebox-test/stock:latest
mkdir -p "$work/workspace"
tar -C "$work" -c . | docker import \
    -c 'ENV PATH=/bin' -c 'CMD ["/bin/sh"]' - slicebox-test/busybox:latest
# git, its helpers and its templates through one tar (git-core's links stay links), without the
# servers and transports a sandbox's clone, commit and push never run; /usr/bin/git is a link to
# git-core's copy. Then every shared library git and its HTTP transport load, the dynamic loader
# included, each at its own path (no ld.so.cache: the loader's default directories find them).
tar -C / -c --exclude=git-daemon --exclude=git-http-backend --exclude=git-imap-send \
    --exclude=git-shell --exclude=git-http-push --exclude=scalar \
    usr/lib/git-core usr/share/git-core/templates | tar -C "$work" -x
mkdir -p "$work/usr/bin"
ln -s ../lib/git-core/git "$work/usr/bin/git"
for lib in $(ldd /usr/bin/git /usr/lib/git-core/git-remote-http \
             | awk '$2 == "=>" && $3 ~ /^\// {print $3} $1 ~ /^\// && $2 ~ /^\(/ {print $1}' \
             | sort -u); do
    cp -L --parents "$lib" "$work"
done
tar -C "$work" -c . | docker import \
    -c 'ENV PATH=/bin:/usr/bin' -c 'CMD ["/bin/sh"]' - slicebox-test/git:latest
rm -rf "$work"
# The same test images in Podman's store, for the backend's run against Podman's API.
docker save slicebox-test/busybox:latest slicebox-test/stock:latest | podman load -q
docker image ls
podman image ls
