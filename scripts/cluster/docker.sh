#!/usr/bin/env bash
# Install and start a Docker engine (Debian's docker.io) for roving's docker backend tests, and build
# the test image locally (no registry is reachable here). Idempotent.
#
# The engine runs without iptables and without a bridge: containers use --network host.
# The image `roving-test:latest` is a minimal root filesystem made here and imported (`docker import`):
# symlinks /bin, /lib, /lib64, /sbin into /usr, and /etc/passwd. The tests bind-mount the host's /usr and
# Python installation read-only into each container (the `docker_volumes` option), so that a container
# runs the very Python, roving and dependencies of the test run.
set -euo pipefail
IMAGE=${SETUP_TEST_IMAGE:-roving-test:latest}
LOG=/var/log/roving-dockerd.log

if ! command -v dockerd >/dev/null; then
    [ -n "${SETUP_APT_UPDATED:-}" ] || apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends docker.io
fi

if ! timeout 10 docker info >/dev/null 2>&1; then
    setsid nohup dockerd --iptables=false --bridge=none >"$LOG" 2>&1 < /dev/null &
    for _ in $(seq 120); do timeout 5 docker info >/dev/null 2>&1 && break; sleep 0.5; done
    if ! timeout 10 docker info >/dev/null 2>&1; then
        echo "docker: the engine did not start; its log:" >&2; tail -30 "$LOG" >&2; exit 1
    fi
fi
echo "docker: engine $(docker version -f '{{.Server.Version}}') answers"

if ! docker image inspect "$IMAGE" >/dev/null 2>&1; then
    ROOT=$(mktemp -d)
    trap 'rm -rf "$ROOT"' EXIT
    mkdir -p "$ROOT"/{usr,etc,tmp,root,proc,sys,dev,var/tmp,sbin}
    chmod 1777 "$ROOT/tmp" "$ROOT/var/tmp"
    # /sbin is a real folder: docker mounts its init (tini) at /sbin/docker-init
    for d in bin lib lib64; do ln -s "usr/$d" "$ROOT/$d"; done
    printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n' > "$ROOT/etc/passwd"
    printf 'root:x:0:\nnogroup:x:65534:\n' > "$ROOT/etc/group"
    tar -C "$ROOT" -c . | docker import -c 'ENV PATH=/usr/local/bin:/usr/bin:/bin' - "$IMAGE" >/dev/null
    echo "docker: built image $IMAGE"
fi
