"""A fake Kubernetes API server for roving's kubernetes backend tests: the Pod endpoints it uses, and
each pod run as a local process.

No Kubernetes API server can run on the machines these tests run on (no kube-apiserver, kubelet or
images), so the tests talk to this instead, through the official kubernetes client. It serves, on
127.0.0.1 only:

* ``GET /version``; ``GET /api/v1/nodes`` (one node with the capacity given);
* ``POST /api/v1/namespaces/NS/pods`` (each taking ``create_delay`` seconds, recorded in ``creations``; the
  next ``refuse_pods`` refused with 429): the pod is scheduled if its requests fit what is left on the node
  (else it stays ``Pending`` with condition ``PodScheduled=False, reason Unschedulable`` and a message as
  the scheduler's), then its first container's command runs as a local process with the pod's env and
  working directory; phase ``Running``, then ``Succeeded`` or ``Failed`` with
  ``containerStatuses[0].state.terminated.exitCode`` (128+N when killed by signal N, as runtimes report);
* ``GET .../pods/NAME``, ``GET .../pods?labelSelector=k=v,...``, ``GET .../pods/NAME/log``;
* ``DELETE .../pods/NAME``: SIGTERM (``gracePeriodSeconds`` > 0, default 30, then SIGKILL) or SIGKILL
  (0); the pod is gone once its process has ended. Pods whose ``ownerReferences`` name a deleted pod's
  uid are deleted too, as Kubernetes' garbage collector does (Secrets too);
* env ``valueFrom.fieldRef: status.podIP`` resolves to the fake pods' IP, 127.0.0.1;
* ``POST /api/v1/namespaces/NS/secrets`` (``data`` base64, or ``stringData`` plain, stored as base64),
  ``GET`` and ``DELETE .../secrets/NAME``. A container env entry ``valueFrom.secretKeyRef`` is resolved
  when the pod starts, as the kubelet does; a missing Secret or key keeps the pod ``Pending`` with its
  container waiting, reason ``CreateContainerConfigError``.
* with ``memory_limits=True``, a pod's container runs in a memory cgroup limited to its
  ``resources.limits.memory``, as a container runtime runs it; a pod whose process the kernel's OOM killer
  ended there terminates with reason ``OOMKilled`` and exit code 137, as the kubelet reports it.
* a pod mounts its service account's token unless its spec says ``automountServiceAccountToken: false``
  (the fake's service account, like a namespace's ``default`` one, does not turn it off): each pod
  created is kept in ``created``, with ``FakePod.mounts_token`` saying whether the kubelet would mount it.
"""
from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Dict, Optional
from urllib.parse import parse_qs, urlparse

_POD = re.compile(r"^/api/v1/namespaces/([^/]+)/pods(?:/([^/]+))?(?:/(log))?$")
_SECRET = re.compile(r"^/api/v1/namespaces/([^/]+)/secrets(?:/([^/]+))?$")


def cpu_value(text) -> float:
    text = str(text)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def memory_value(text) -> int:
    text = str(text)
    for suffix, factor in (("Ki", 2**10), ("Mi", 2**20), ("Gi", 2**30), ("Ti", 2**40), ("K", 10**3),
                           ("M", 10**6), ("G", 10**9), ("T", 10**12)):
        if text.endswith(suffix):
            return int(float(text[:-len(suffix)]) * factor)
    return int(float(text))


class FakePod:
    def __init__(self, body: dict, namespace: str, log_dir: str) -> None:
        self.body = body
        meta = body.setdefault("metadata", {})
        meta["namespace"] = namespace
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.name = meta["name"]
        self.log_path = os.path.join(log_dir, f"{namespace}-{self.name}.log")
        self.proc: Optional[subprocess.Popen] = None
        self.deleting = False
        self.status = {"phase": "Pending", "conditions": []}
        container = body["spec"]["containers"][0]
        requests = (container.get("resources") or {}).get("requests") or {}
        self.cpu = cpu_value(requests.get("cpu", "0"))
        self.memory = memory_value(requests.get("memory", "0"))
        self.gpu = int(requests.get("nvidia.com/gpu", 0))
        limits = (container.get("resources") or {}).get("limits") or {}
        self.memory_limit = memory_value(limits["memory"]) if "memory" in limits else None
        self.group = None  # its memory cgroup, with memory_limits on
        #: whether the kubelet would mount the service account's token into the pod's containers
        self.mounts_token = body["spec"].get("automountServiceAccountToken") is not False

    def start(self, secrets: dict, memory_limits: bool = False) -> None:
        c = self.body["spec"]["containers"][0]
        env = {}
        for e in c.get("env") or []:
            if ((e.get("valueFrom") or {}).get("fieldRef") or {}).get("fieldPath") == "status.podIP":
                env[e["name"]] = "127.0.0.1"  # every fake pod's IP
                continue
            ref = (e.get("valueFrom") or {}).get("secretKeyRef")
            if ref is None:
                env[e["name"]] = e.get("value", "")
                continue
            data = (secrets.get((self.body["metadata"]["namespace"], ref["name"])) or {}).get("data") or {}
            if ref["key"] not in data:
                self.status["containerStatuses"] = [{"name": c["name"], "ready": False, "restartCount": 0,
                                                     "image": c["image"], "imageID": "", "state": {"waiting": {
                                                         "reason": "CreateContainerConfigError",
                                                         "message": f'secret "{ref["name"]}" not found'}}}]
                return
            env[e["name"]] = base64.b64decode(data[ref["key"]]).decode()
        env.setdefault("PATH", os.environ.get("PATH", "/usr/bin:/bin"))
        env["HOSTNAME"] = self.name
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(list(c.get("command") or []) + list(c.get("args") or []), env=env,
                                         cwd=c.get("workingDir") or "/", stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        if memory_limits and self.memory_limit is not None:
            # the container runtime's part: the process in a cgroup with the container's limit (made with
            # roving's own helper; what is tested is the backend's reading of the pod's status)
            from roving.backends.memory import make_group

            self.group, why = make_group(self.memory_limit, self.name)
            if self.group is None:
                raise RuntimeError(f"the fake cannot limit a pod's memory here: {why}")
            self.group.add(self.proc.pid)
        self.status = {"phase": "Running", "podIP": "127.0.0.1",
                       "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Ready", "status": "True"}],
                       "containerStatuses": [{"name": c["name"], "ready": True, "restartCount": 0, "image": c["image"],
                                              "imageID": "fake://" + c["image"],
                                              "state": {"running": {}}}]}

    def poll(self) -> None:
        if self.proc is None or self.status["phase"] in ("Succeeded", "Failed"):
            return
        code = self.proc.poll()
        if code is None:
            return
        exit_code = 128 - code if code < 0 else code
        terminated = {"exitCode": exit_code, "reason": "Completed" if code == 0 else "Error"}
        if self.group is not None and self.group.oom_killed():
            terminated["reason"] = "OOMKilled"
        if self.group is not None:
            self.group.remove()
        if code < 0:
            terminated["signal"] = -code
        self.status["phase"] = "Succeeded" if code == 0 else "Failed"
        self.status["containerStatuses"][0].update(ready=False, state={"terminated": terminated})

    def json(self) -> dict:
        self.poll()
        return {"apiVersion": "v1", "kind": "Pod", **self.body, "status": self.status}


class FakeKubernetes:
    """The server, its pods, and the one node's capacity. Use as a context manager."""

    def __init__(self, cpu: float = 8, memory: int = 16 * 2**30, gpu: int = 0, memory_limits: bool = False) -> None:
        self.capacity = {"cpu": cpu, "memory": memory, "gpu": gpu}
        self.memory_limits = memory_limits
        self.pods: Dict[tuple, FakePod] = {}
        self.secrets: Dict[tuple, dict] = {}
        self.lock = threading.RLock()
        self.log_dir = tempfile.mkdtemp(prefix="fake-k8s-")
        self.requests: list = []  # (method, path) of every request, for tests to check
        #: Seconds each pod creation takes (outside the server's lock, so creations can overlap), and
        #: the (start, end) of each, time.monotonic(): tests see whether a client created pods concurrently.
        self.create_delay = 0.0
        self.creations: list = []
        self.created: list = []  # every FakePod created, in order (pods leaves them when deleted)
        #: The next this many pod creations are refused with 429 Too Many Requests (a rate limit).
        self.refuse_pods = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, body) -> None:
                data = body if isinstance(body, bytes) else json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain" if isinstance(body, bytes) else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _body(self) -> dict:
                length = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(length) or b"{}")

            def do_GET(self):
                fake.handle(self, "GET")

            def do_POST(self):
                fake.handle(self, "POST")

            def do_DELETE(self):
                fake.handle(self, "DELETE")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    # -- lifecycle ---------------------------------------------------------------------------------
    def __enter__(self) -> "FakeKubernetes":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self._stop = threading.Event()
        threading.Thread(target=self._scheduler, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self.server.shutdown()
        self.server.server_close()
        with self.lock:
            for pod in self.pods.values():
                if pod.proc is not None and pod.proc.poll() is None:
                    os.killpg(pod.proc.pid, signal.SIGKILL)
                    pod.proc.wait()
        shutil.rmtree(self.log_dir, ignore_errors=True)  # the pods' logs: read through the API while it ran

    def kubeconfig(self, path: str) -> str:
        config = {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
                  "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                  "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                  "users": [{"name": "fake", "user": {"token": "fake-token"}}]}
        with open(path, "w") as f:
            json.dump(config, f)
        return path

    def _scheduler(self) -> None:
        """Starts pending pods whose requests fit; as kube-scheduler and kubelet would, much simplified."""
        while not self._stop.wait(0.05):
            with self.lock:
                for pod in list(self.pods.values()):
                    pod.poll()
                    if pod.deleting and (pod.proc is None or pod.proc.poll() is not None):
                        self._gone(pod)
                    elif pod.proc is None and not pod.deleting:
                        self._try_schedule(pod)

    def _used(self):
        used = {"cpu": 0.0, "memory": 0, "gpu": 0}
        for pod in self.pods.values():
            if pod.proc is not None and pod.status["phase"] == "Running":
                used["cpu"] += pod.cpu
                used["memory"] += pod.memory
                used["gpu"] += pod.gpu
        return used

    def _try_schedule(self, pod: FakePod) -> None:
        used, cap = self._used(), self.capacity
        short = [name for name, want, key in (("cpu", pod.cpu, "cpu"), ("memory", pod.memory, "memory"),
                                              ("nvidia.com/gpu", pod.gpu, "gpu"))
                 if want > cap[key] - used[key]]
        if short:
            message = f"0/1 nodes are available: {', '.join('1 Insufficient ' + s for s in short)}."
            pod.status["conditions"] = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                         "message": message}]
            return
        pod.start(self.secrets, self.memory_limits)

    def _secrets(self, h, method: str, namespace: str, name: Optional[str]) -> None:
        _secret_api(self, h, method, namespace, name)

    def _gone(self, pod: FakePod) -> None:
        key = (pod.body["metadata"]["namespace"], pod.name)
        self.pods.pop(key, None)
        uid = pod.body["metadata"]["uid"]
        for other in list(self.pods.values()):  # the garbage collector: dependents go with their owner
            if any(ref.get("uid") == uid for ref in other.body["metadata"].get("ownerReferences") or []):
                self._delete(other, 30)
        for key, secret in list(self.secrets.items()):
            if any(ref.get("uid") == uid for ref in secret["metadata"].get("ownerReferences") or []):
                self.secrets.pop(key)

    def _delete(self, pod: FakePod, grace: int) -> None:
        pod.deleting = True
        pod.body["metadata"]["deletionTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        if pod.proc is not None and pod.proc.poll() is None:
            os.killpg(pod.proc.pid, signal.SIGKILL if grace == 0 else signal.SIGTERM)
            if grace:
                def later(proc=pod.proc):
                    time.sleep(grace)
                    if proc.poll() is None:
                        os.killpg(proc.pid, signal.SIGKILL)
                threading.Thread(target=later, daemon=True).start()

    # -- the API -----------------------------------------------------------------------------------
    def handle(self, h, method: str) -> None:
        url = urlparse(h.path)
        query = parse_qs(url.query)
        self.requests.append((method, url.path))
        if url.path.rstrip("/") == "/version":
            return h._send(200, {"major": "1", "minor": "29", "gitVersion": "v1.29.0-roving-fake",
                                 "gitCommit": "0", "gitTreeState": "clean", "buildDate": "2024-01-01T00:00:00Z",
                                 "goVersion": "go1.21", "compiler": "gc", "platform": "linux/amd64"})
        if url.path == "/api/v1/nodes" and method == "GET":
            cap = self.capacity
            node = {"metadata": {"name": "fake-node"}, "status": {"capacity": {
                "cpu": str(cap["cpu"]), "memory": f"{cap['memory'] // 2**10}Ki", "nvidia.com/gpu": str(cap["gpu"])},
                "allocatable": {"cpu": str(cap["cpu"]), "memory": f"{cap['memory'] // 2**10}Ki",
                                "nvidia.com/gpu": str(cap["gpu"])}}}
            return h._send(200, {"kind": "NodeList", "apiVersion": "v1", "metadata": {}, "items": [node]})
        sm = _SECRET.match(url.path)
        if sm:
            return self._secrets(h, method, *sm.groups())
        m = _POD.match(url.path)
        if not m:
            return h._send(404, _status(404, "NotFound", f"the fake serves no {url.path}"))
        namespace, name, log = m.groups()
        if method == "POST" and name is None:
            t0 = time.monotonic()
            time.sleep(self.create_delay)
            with self.lock:
                self.creations.append((t0, time.monotonic()))
                refuse, self.refuse_pods = self.refuse_pods > 0, max(0, self.refuse_pods - 1)
            if refuse:
                return h._send(429, _status(429, "TooManyRequests", "the fake's rate limit: too many requests, "
                                                                    "please try again later"))
        with self.lock:
            if method == "POST" and name is None:
                body = h._body()
                if (namespace, body["metadata"]["name"]) in self.pods:
                    return h._send(409, _status(409, "AlreadyExists",
                                                f'pods "{body["metadata"]["name"]}" already exists'))
                pod = FakePod(body, namespace, self.log_dir)
                self.pods[(namespace, pod.name)] = pod
                self.created.append(pod)
                self._try_schedule(pod)
                return h._send(201, pod.json())
            if method == "GET" and name is None:
                selector = dict(item.split("=", 1) for item in (query.get("labelSelector", [""])[0]).split(",")
                                if "=" in item)
                items = [p.json() for (ns, _), p in self.pods.items() if ns == namespace and all(
                    (p.body["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items())]
                return h._send(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items})
            pod = self.pods.get((namespace, name))
            if pod is None:
                return h._send(404, _status(404, "NotFound", f'pods "{name}" not found'))
            if method == "GET" and log:
                with open(pod.log_path, "rb") as f:
                    return h._send(200, f.read())
            if method == "GET":
                return h._send(200, pod.json())
            if method == "DELETE":
                body = h._body()
                grace = int(query.get("gracePeriodSeconds", [body.get("gracePeriodSeconds", 30)])[0])
                self._delete(pod, grace)
                return h._send(200, pod.json())
        return h._send(405, _status(405, "MethodNotAllowed", method))


def _secret_api(fake: "FakeKubernetes", h, method: str, namespace: str, name: Optional[str]) -> None:
    with fake.lock:
        if method == "POST" and name is None:
            body = h._body()
            meta = body.setdefault("metadata", {})
            key = (namespace, meta.get("name"))
            if key in fake.secrets:
                return h._send(409, _status(409, "AlreadyExists", f'secrets "{key[1]}" already exists'))
            meta.update(namespace=namespace, uid=str(uuid.uuid4()))
            data = dict(body.get("data") or {})
            for k, v in (body.pop("stringData", None) or {}).items():
                data[k] = base64.b64encode(v.encode()).decode()
            body["data"] = data
            fake.secrets[key] = body
            return h._send(201, {"apiVersion": "v1", "kind": "Secret", **body})
        secret = fake.secrets.get((namespace, name))
        if secret is None:
            return h._send(404, _status(404, "NotFound", f'secrets "{name}" not found'))
        if method == "GET":
            return h._send(200, {"apiVersion": "v1", "kind": "Secret", **secret})
        if method == "DELETE":
            fake.secrets.pop((namespace, name))
            return h._send(200, _status(200, "Success", "deleted") | {"status": "Success"})
    return h._send(405, _status(405, "MethodNotAllowed", method))


def _status(code: int, reason: str, message: str) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message, "reason": reason,
            "code": code}
