#!/bin/sh
# Runs once inside the freshly built guest, before the image is marked ready: things that need
# a running dockerd. Images are made locally because the guest reaches no image registry.
#
# Two images from one busybox rootfs:
#   slicebox-test/busybox:latest  with a world-writable /workspace baked in
#   slicebox-test/stock:latest    without it, like a stock image (alpine:3.19): the default
#                                 exec cwd must work on such an image too
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
rm -rf "$work"
docker image ls
