#!/usr/bin/env bash
# Install and start a Docker engine (Debian's docker.io) for roving's docker backend tests, and build
# the test image locally (no registry is reachable here). Idempotent.
#
# The engine runs without iptables and without a bridge: containers use --network host.
# The image `roving-test:latest` is a minimal root filesystem made here and imported (`docker import`):
# symlinks /bin, /lib, /lib64, /sbin into /usr, and /etc/passwd. The tests bind-mount the host's /usr and
# Python installation read-only into each container (the `docker_volumes` option), so that a container
# runs the very Python, roving and dependencies of the test run.
. "$(dirname "${BASH_SOURCE[0]}")/../fail-loudly.sh"
IMAGE=${SETUP_TEST_IMAGE:-roving-test:latest}
LOG=/var/log/roving-dockerd.log
# shellcheck source=hosts.env
. "$(dirname "$0")/hosts.env"

if [ "${1:-}" = --down ]; then
    # the test network and image removed, the engine stopped (its own containerd with it): what a fresh
    # machine has once docker.io is installed
    if timeout 10 docker info >/dev/null 2>&1; then
        docker network rm "$DOCKER_TEST_NETWORK" >/dev/null 2>&1 || true
        docker image rm -f "$IMAGE" >/dev/null 2>&1 || true
    fi
    pkill -x dockerd || true
    for _ in $(seq 300); do
        pgrep -x dockerd >/dev/null || pgrep -f /var/run/docker/containerd/ >/dev/null || break
        sleep 0.1
    done
    ! pgrep -x dockerd >/dev/null || { echo "docker: dockerd still running after 30 s" >&2; exit 1; }
    echo "docker: down (engine stopped; network $DOCKER_TEST_NETWORK and image $IMAGE removed)"
    exit 0
fi

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

# A user-defined bridge network (names in hosts.env) for the tests of containers with their own addresses
# (the `docker_network` option): each container gets an address in $DOCKER_TEST_SUBNET and reaches this
# machine at the gateway, $DOCKER_TEST_GATEWAY, which Docker puts on the bridge $DOCKER_TEST_BRIDGE.
subnet=$(docker network inspect -f '{{range .IPAM.Config}}{{.Subnet}} {{.Gateway}}{{end}}' "$DOCKER_TEST_NETWORK" \
    2>/dev/null || true)
if [ "$subnet" != "$DOCKER_TEST_SUBNET $DOCKER_TEST_GATEWAY" ]; then
    if [ -n "$subnet" ]; then
        echo "docker: network $DOCKER_TEST_NETWORK has '$subnet', not" \
            "'$DOCKER_TEST_SUBNET $DOCKER_TEST_GATEWAY': making it anew"
        docker network rm "$DOCKER_TEST_NETWORK" >/dev/null
    fi
    other=$(ip -4 route show to match "${DOCKER_TEST_SUBNET%/*}" | grep -v '^default' || true)
    if [ -n "$other" ]; then
        echo "docker: the subnet $DOCKER_TEST_SUBNET is already routed here: '$other'; change hosts.env" >&2; exit 1
    fi
    docker network create --driver bridge --subnet "$DOCKER_TEST_SUBNET" --gateway "$DOCKER_TEST_GATEWAY" \
        -o "com.docker.network.bridge.name=$DOCKER_TEST_BRIDGE" "$DOCKER_TEST_NETWORK" >/dev/null
    echo "docker: made network $DOCKER_TEST_NETWORK ($DOCKER_TEST_SUBNET, this machine at $DOCKER_TEST_GATEWAY)"
fi
# a container on it must reach this machine at the gateway: a listener here, a connection from a container
# running the host's Python (mounted read-only, as the tests do)
"$(command -v python3)" - "$DOCKER_TEST_GATEWAY" "$DOCKER_TEST_NETWORK" "$IMAGE" <<'PY'
import socket, subprocess, sys, time
gateway, network, image = sys.argv[1:]
prefixes = sorted({sys.base_prefix, sys.prefix})
with socket.create_server((gateway, 0)) as server:
    server.settimeout(0.5)
    port = server.getsockname()[1]
    probe = (f"import socket; c = socket.create_connection(({gateway!r}, {port}), timeout=10); "
             "c.sendall(socket.gethostbyname(socket.gethostname()).encode())")
    mounts = [a for p in ["/usr", *prefixes] for a in ("-v", f"{p}:{p}:ro")]
    run = subprocess.Popen(["docker", "run", "--rm", "--network", network, *mounts, image, sys.executable,
                            "-c", probe], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    conn, deadline = None, time.monotonic() + 60
    while conn is None and run.poll() is None and time.monotonic() < deadline:
        try:
            conn, (peer, _) = server.accept()
        except socket.timeout:
            pass
    if conn is None:
        run.kill()
        out, _ = run.communicate()
        sys.exit(f"docker: a container on {network} did not reach this machine at {gateway}:{port} within 60 s "
                 f"(exit {run.returncode}); its output: {out.strip()}")
    with conn:
        conn.settimeout(10)
        said = conn.recv(100).decode()
    try:
        out, _ = run.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        run.kill()
        out, _ = run.communicate()
if run.returncode != 0:
    sys.exit(f"docker: the probe container on {network} failed (exit {run.returncode}): {out.strip()}")
print(f"docker: a container on {network} at {peer} (it says {said}) reaches this machine at {gateway}")
PY
