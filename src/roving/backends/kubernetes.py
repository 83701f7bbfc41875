"""The kubernetes backend: each job is a Pod (official kubernetes client for Python).

* The pod runs the ``image`` option's image with the process's command, environment and working
  directory, resource requests and limits from the process resources (``nvidia.com/gpu`` for GPUs), in the
  ``kubernetes_namespace`` (default: the parent pod's own namespace, else ``default``), with labels
  ``roving.session``, ``roving.name``, ``roving.user`` and ``roving.owner`` (a keyed hash only this user's
  key makes: `roving cancel --all` matches it, :func:`.containers.owner_label`), and ``restartPolicy: Never``.
* Inside a pod (POD_NAME, or HOSTNAME, names it) the workers get an ownerReference to the parent's pod, so
  that deleting the parent deletes its workers.
* Phases map to exit codes: Succeeded is the container's exit code (0), Failed its exit code, or ``-N``
  when killed by signal N (runtimes report 128+N); a pod that is Pending reports its conditions' reason.
* ``terminate_job`` deletes the pod with a grace period (SIGTERM, exit code -15), ``force`` with none
  (SIGKILL, -9). An ended pod is deleted once its end and output are read.
* A parent that advertises an address (``advertise``, its pod IP) gives each worker pod its own pod IP to
  advertise (``valueFrom.fieldRef: status.podIP``), not the parent's.
* The secret a pod authenticates with (the session's member secret and the pod's own credentials' seed,
  roving.transport.identity) is not in the pod spec, which anyone allowed to read pods could see: it goes
  into a Secret of the pod's own (named as the pod, owned by the parent's pod when there is one), which
  the pod's env references (``valueFrom.secretKeyRef``). Each is deleted with its pod, when the session
  ends, and by the watcher process when the parent dies.
* Worker pods do not mount the namespace's service-account token (``automountServiceAccountToken:
  false``): what a worker runs cannot use the cluster's API with that account's rights. So a worker cannot
  start pods of its own: start every process from the parent (a child that tries gets an error saying so).
* The client is configured in-cluster inside a pod, else from the kubeconfig (KUBECONFIG).
"""
from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union
from urllib.parse import urlparse

from .. import config as _config
from . import throttle
from .base import Backend, Job, JobInfo, JobSpec, JobState, JobStatus, user_name
from .containers import container_env, owner_label
from .errors import KubernetesError, UnknownJobError
from .output import LineSplitter
from ..system.private import open_private
from .reaper import Reaper

log = logging.getLogger(__name__)
_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
_REFRESH_S = 0.2
_TIMEOUT = 10


def _dns_name(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:30] or "p"


def _user_label(user: str) -> str:
    """A user name as a label value (letters, digits, '-', '_', '.'; at most 63)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", user)[:63].strip("-_.") or "unknown"


def _quantity_cpu(text: str) -> float:
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _quantity_bytes(text: str) -> int:
    return _config.parse_memory(text.replace("Ki", "K").replace("Mi", "M").replace("Gi", "G").replace("Ti", "T"))


class _Pod:
    def __init__(self, spec: JobSpec, name: str) -> None:
        self.spec, self.name = spec, name
        self.status = JobStatus(JobState.PENDING)
        self.deleted_with: Optional[int] = None  # the exit code asked for by terminate_job
        self.output = ""
        self.since = time.monotonic()
        self.warned = False


class KubernetesBackend(Backend):
    name = "kubernetes"

    def __init__(self) -> None:
        self._api: Any = None  # the client's CoreV1Api, made on first use
        self._lock = threading.Lock()
        self._pods: Dict[str, _Pod] = {}
        self._checked_at = 0.0
        self._reaper = Reaper(self.name)
        self._owner: Optional[dict] = None
        self._owner_checked = False
        self._secrets: Set[str] = set()  # the Secrets of this process's pods (each named as its pod)
        self._followers: List[threading.Thread] = []  # the threads that print or keep pods' output

    # -- the API ---------------------------------------------------------------------------------
    def api(self) -> Any:
        if self._api is None:
            try:
                import kubernetes
            except ImportError:
                raise KubernetesError("the kubernetes backend needs the kubernetes client: "
                                      "pip install 'roving[kubernetes]'") from None
            if (os.environ.get("KUBERNETES_SERVICE_HOST") and not os.path.exists(_NAMESPACE_FILE)
                    and not os.environ.get("KUBECONFIG")):
                raise KubernetesError("this process runs in a pod without a service-account token (roving's "
                                      "worker pods are started without one: automountServiceAccountToken: "
                                      "false), so it cannot start pods: start every process from the parent")
            try:
                configuration = kubernetes.client.Configuration()
                if os.environ.get("KUBERNETES_SERVICE_HOST") and os.path.exists(_NAMESPACE_FILE):
                    kubernetes.config.load_incluster_config(client_configuration=configuration)
                else:  # KUBECONFIG read now: the client reads it once, at its import
                    kubernetes.config.load_kube_config(config_file=os.environ.get("KUBECONFIG"),
                                                       client_configuration=configuration)
                configuration.retries = 0  # an unreachable server is an error at once, not after retries
                configuration.connection_pool_maxsize = throttle.CONCURRENCY  # pods created concurrently
                client = kubernetes.client.ApiClient(configuration)
                kubernetes.client.VersionApi(client).get_code(_request_timeout=_TIMEOUT)
            except Exception as exc:
                raise KubernetesError(f"the Kubernetes API server is not reachable ({_short(exc)}); check "
                                      "KUBECONFIG or the pod's service account") from None
            self._api = kubernetes.client.CoreV1Api(client)
        return self._api

    @property
    def namespace(self) -> str:
        ns = _config.current().kubernetes_namespace
        if ns:
            return ns
        if os.path.exists(_NAMESPACE_FILE):
            with open(_NAMESPACE_FILE) as f:
                return f.read().strip()
        return "default"

    def _owner_reference(self) -> Optional[dict]:
        """This process's own pod, when it runs in one: the owner of its workers."""
        if not self._owner_checked:
            self._owner_checked = True
            name = os.environ.get("POD_NAME") or (
                os.environ.get("HOSTNAME") if os.environ.get("KUBERNETES_SERVICE_HOST") else None)
            if name:
                try:
                    pod = self.api().read_namespaced_pod(name, self.namespace, _request_timeout=_TIMEOUT)
                    self._owner = {"apiVersion": "v1", "kind": "Pod", "name": name, "uid": pod.metadata.uid,
                                   "blockOwnerDeletion": False}
                except Exception as exc:
                    log.warning("roving: cannot read this process's own pod %s (%s): workers get no "
                                "ownerReference", name, _short(exc))
        return self._owner

    def _capacity(self) -> Optional[dict]:
        """The largest node's allocatable cpu, memory and GPUs; None when nodes may not be listed."""
        try:
            nodes = self.api().list_node(_request_timeout=_TIMEOUT).items
        except Exception:
            return None
        best = {"cpu": 0.0, "memory": 0, "gpu": 0}
        for node in nodes:
            alloc = node.status.allocatable or {}
            best["cpu"] = max(best["cpu"], _quantity_cpu(alloc.get("cpu", "0")))
            best["memory"] = max(best["memory"], _quantity_bytes(alloc.get("memory", "1")))
            best["gpu"] = max(best["gpu"], int(alloc.get("nvidia.com/gpu", "0")))
        return best

    # -- jobs ------------------------------------------------------------------------------------
    def create_job(self, spec: JobSpec) -> Job:
        from kubernetes.client.rest import ApiException

        cfg = _config.current()
        if not cfg.image:
            raise KubernetesError("the kubernetes backend needs an image: set the roving option `image`")
        api = self.api()
        res = spec.resources
        cap = self._capacity()
        if cap is not None:
            for what, want, have in (("GPUs", res.gpu, cap["gpu"]), ("CPUs", res.cpu, cap["cpu"]),
                                     ("bytes of memory", res.memory or 0, cap["memory"])):
                if want > have:
                    raise KubernetesError(f"{spec.name} asks for {want:g} {what}; the largest node of the "
                                          f"cluster has {have:g}")
        amounts = {"cpu": f"{int(res.cpu * 1000)}m"}
        if res.memory:
            amounts["memory"] = str(res.memory)
        if res.gpu:
            amounts["nvidia.com/gpu"] = str(res.gpu)
        tag = spec.session.tag
        name = f"roving-{tag}-{_dns_name(spec.name)}-{os.urandom(3).hex()}"
        # Only what roving needs and what forward_env names; the secret travels in a Secret.
        env, secret = container_env(spec, cfg.forward_env)
        from_refs = []
        if "ROVING_ADVERTISE" in env:  # the parent's own pod IP, inherited: each pod advertises its own
            env.pop("ROVING_ADVERTISE")
            from_refs.append({"name": "ROVING_ADVERTISE", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
        if secret:
            from_refs.append({"name": spec.session.secret_env, "valueFrom": {"secretKeyRef": {
                "name": self._pod_secret(tag, name, secret), "key": "secret"}}})
        metadata: Dict[str, Any] = {
            "name": name, "labels": {"app.kubernetes.io/managed-by": "roving", "roving.session": tag,
                                     "roving.name": _dns_name(spec.name),
                                     "roving.user": _user_label(user_name()),
                                     "roving.owner": owner_label()},
            "annotations": {"roving.process-name": spec.name}}
        owner = self._owner_reference()
        if owner:
            metadata["ownerReferences"] = [owner]
        # A worker is no client of the cluster: without the namespace's service-account token mounted, code
        # it runs (or a compromised worker) cannot act on the cluster with that account's rights.
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": {
            "restartPolicy": "Never", "automountServiceAccountToken": False, "containers": [{
                "name": "roving", "image": cfg.image, "command": list(spec.command), "workingDir": spec.cwd,
                "env": [{"name": k, "value": v} for k, v in env.items()] + from_refs,
                "resources": {"requests": amounts, "limits": dict(amounts)}}]}}
        try:
            throttle.retry_busy(lambda: api.create_namespaced_pod(self.namespace, body, _request_timeout=_TIMEOUT),
                                _busy, f"creating the pod of {spec.name}")
        except ApiException as exc:
            self._drop_pod_secret(name)
            raise KubernetesError(f"Kubernetes refused the pod for {spec.name}: {_short(exc)}") from None
        except Exception as exc:
            self._drop_pod_secret(name)
            raise KubernetesError(f"the Kubernetes API server is not reachable ({_short(exc)})") from None
        pod = _Pod(spec, name)
        with self._lock:
            self._pods[name] = pod
        self._reaper.add(f"{self.namespace}/{name}")
        if spec.output in ("prefix", "files"):
            follower = threading.Thread(target=self._follow, args=(pod,), name=f"roving-k8s-output-{name}",
                                        daemon=True)
            follower.start()
            with self._lock:
                self._followers = [t for t in self._followers if t.is_alive()] + [follower]
        return Job(self, name)

    def submit_many(self, specs: Sequence[JobSpec]) -> List[Union[Job, Exception]]:
        """Pods created concurrently, at most :data:`throttle.CONCURRENCY` requests at a time."""
        if len(specs) > 1:
            try:  # once, before the threads: the client, this process's own pod
                self.api()
                self._owner_reference()
            except Exception as exc:
                return [exc] * len(specs)
        return throttle.concurrently(self.create_job, specs)

    def _pod_secret(self, tag: str, pod_name: str, secret: str) -> str:
        """Make the Secret that holds the ``secret`` of the pod ``pod_name`` of session ``tag`` (each pod has
        credentials of its own, so a Secret of its own); its name."""
        from kubernetes.client.rest import ApiException

        metadata: Dict[str, Any] = {"name": pod_name, "labels": {"app.kubernetes.io/managed-by": "roving",
                                                     "roving.session": tag}}
        owner = self._owner_reference()
        if owner:
            metadata["ownerReferences"] = [owner]
        body = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque", "metadata": metadata,
                "stringData": {"secret": secret}}
        try:
            self.api().create_namespaced_secret(self.namespace, body, _request_timeout=_TIMEOUT)
        except ApiException as exc:
            raise KubernetesError(f"Kubernetes refused the Secret {pod_name} (the pod's key to authenticate; "
                                  f"the role needs create/delete on secrets): {_short(exc)}") from None
        except Exception as exc:
            raise KubernetesError(f"the Kubernetes API server is not reachable ({_short(exc)})") from None
        with self._lock:
            self._secrets.add(pod_name)
        self._reaper.add(f"{self.namespace}/secret:{pod_name}")
        return pod_name

    def _drop_pod_secret(self, pod_name: str) -> None:
        with self._lock:
            if pod_name not in self._secrets:
                return
            self._secrets.discard(pod_name)
        self._delete_secret(pod_name)
        self._reaper.done(f"{self.namespace}/secret:{pod_name}")

    def _delete_secret(self, name: str, namespace: Optional[str] = None) -> None:
        try:
            self.api().delete_namespaced_secret(name, namespace or self.namespace, _request_timeout=_TIMEOUT)
        except Exception:  # already gone
            pass

    def _read_log(self, name: str) -> str:
        try:
            return self.api().read_namespaced_pod_log(name, self.namespace, _request_timeout=_TIMEOUT) or ""
        except Exception:
            return ""

    def _follow(self, pod: _Pod) -> None:
        """Print (prefix) or keep (files) the pod's log until it ends, then write it and delete the pod."""
        splitter = LineSplitter(f"[{pod.spec.name}] ")
        shown = 0
        delay = 0.1
        while True:
            status = self._poll(pod)
            if status.state is not JobState.PENDING and pod.deleted_with is None:
                text = self._read_log(pod.name)
                if len(pod.output) > len(text):  # the pod is gone: its log as read before it was deleted
                    text = pod.output             # (``_ended``, ``shutdown``), which a log only grows to
                if len(text) > shown:
                    pod.output = text
                    if pod.spec.output == "prefix":
                        splitter.feed(text[shown:].encode())
                    shown = len(text)
            if status.state is JobState.EXITED:
                break
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)
        splitter.close()

    def _poll(self, pod: _Pod) -> JobStatus:
        if pod.status.state is JobState.EXITED:
            return pod.status
        self._refresh()
        return pod.status

    def _refresh(self) -> None:
        from kubernetes.client.rest import ApiException

        with self._lock:
            if time.monotonic() - self._checked_at < _REFRESH_S:
                return
            self._checked_at = time.monotonic()
            live = [p for p in self._pods.values() if p.status.state is not JobState.EXITED]
        if not live:
            return
        found: Dict[str, Any] = {}  # pod name -> the API's pod
        for tag in {p.spec.session.tag for p in live}:  # one: a process has one session
            try:
                items = self.api().list_namespaced_pod(self.namespace, label_selector=f"roving.session={tag}",
                                                       _request_timeout=_TIMEOUT).items
            except ApiException as exc:
                log.warning("roving: cannot list pods: %s", _short(exc))
                return
            found.update((item.metadata.name, item) for item in items)
        for pod in live:
            item = found.get(pod.name)
            if item is None:  # deleted: by us (the code we asked for) or from outside (as SIGTERM)
                self._ended(pod, JobStatus(JobState.EXITED, pod.deleted_with if pod.deleted_with is not None
                                           else -15, "pod deleted"))
                continue
            status = _status_of(item)
            if status.state is JobState.EXITED and pod.deleted_with is not None and status.exitcode == 0:
                status = JobStatus(JobState.EXITED, pod.deleted_with, status.reason)
            if status.state is JobState.PENDING:
                waited = time.monotonic() - pod.since
                if waited > _config.current().pending_warning and not pod.warned:
                    pod.warned = True
                    log.warning("roving: pod %s (%s) has been pending for %.0f s: %s", pod.name, pod.spec.name,
                                waited, status.reason)
            if status.state is JobState.EXITED:
                self._ended(pod, status)
            else:
                pod.status = status

    def _ended(self, pod: _Pod, status: JobStatus) -> None:
        if pod.spec.output == "files":
            text = self._read_log(pod.name) or pod.output
            pod.output = text
            with open_private(pod.spec.log_file(), "a") as f:
                f.write(text)
        elif pod.spec.output == "prefix" and pod.deleted_with is None:
            pod.output = self._read_log(pod.name) or pod.output
        pod.status = status
        self._delete(pod.name, 0)
        self._reaper.done(f"{self.namespace}/{pod.name}")
        self._drop_pod_secret(pod.name)

    def _delete(self, name: str, grace: int, namespace: Optional[str] = None) -> None:
        try:
            self.api().delete_namespaced_pod(name, namespace or self.namespace, grace_period_seconds=grace,
                                             _request_timeout=_TIMEOUT)
        except Exception:  # already gone
            pass

    def job_status(self, job: Job) -> JobStatus:
        pod = self._pods.get(job.id)
        if pod is not None:
            return self._poll(pod)
        from kubernetes.client.rest import ApiException

        try:
            return _status_of(self.api().read_namespaced_pod(job.id, self.namespace, _request_timeout=_TIMEOUT))
        except ApiException:
            return JobStatus(JobState.EXITED, -15, "no such pod")

    def terminate_job(self, job: Job, force: bool = False) -> None:
        pod = self._pods.get(job.id)
        if pod is not None:
            if pod.status.state is JobState.EXITED:
                return
            pod.deleted_with = -9 if force else -15
        self._delete(job.id, 0 if force else 30)

    def logs(self, job: Job) -> str:
        pod = self._pods.get(job.id)
        if pod is not None and pod.status.state is JobState.EXITED:
            return pod.output
        from kubernetes.client.rest import ApiException

        try:
            return self.api().read_namespaced_pod_log(job.id, self.namespace, _request_timeout=_TIMEOUT) or ""
        except ApiException as exc:
            if exc.status == 404:
                raise UnknownJobError(f"no pod {job.id} in namespace {self.namespace}") from None
            raise KubernetesError(f"cannot read the log of pod {job.id}: {exc.status} {exc.reason}") from None

    def shares_filesystem(self) -> bool:
        """A pod sees its image and its volumes, never this machine's files."""
        return False

    def cpu_count(self) -> int:
        cap = self._capacity()
        return max(1, int(cap["cpu"])) if cap else (os.cpu_count() or 1)

    def towards(self) -> Optional[Tuple[str, str]]:
        """The API server's host: in a pod, the route there leaves by the pod's own address, which the
        other pods reach."""
        host = urlparse(self.api().api_client.configuration.host).hostname
        return (host, f"the Kubernetes API server {host}") if host else None

    def describe(self) -> Dict[str, str]:
        import kubernetes

        version = kubernetes.client.VersionApi(self.api().api_client).get_code(_request_timeout=_TIMEOUT)
        cap = self._capacity()
        info = {"api server": f"{self.api().api_client.configuration.host} ({version.git_version})",
                "namespace": self.namespace, "image": _config.current().image or "(none: set the `image` option)"}
        if cap:
            info["largest node"] = f"{cap['cpu']:g} CPUs, {cap['memory'] / 2**30:.1f} GiB, {cap['gpu']} GPUs"
        info["owner pod"] = (self._owner_reference() or {}).get("name", "(none: not inside a pod)")
        return info

    def list_jobs(self, user: Optional[str] = None) -> List[JobInfo]:
        # a user's pods: those that carry the label only this user's key makes (containers.owner_label)
        selector = "app.kubernetes.io/managed-by=roving" + (f",roving.owner={owner_label(user)}" if user else "")
        items = self.api().list_namespaced_pod(self.namespace, label_selector=selector,
                                               _request_timeout=_TIMEOUT).items
        out = []
        for item in items:
            status = _status_of(item)
            out.append(JobInfo(id=item.metadata.name,
                               name=(item.metadata.annotations or {}).get("roving.process-name", ""),
                               session=(item.metadata.labels or {}).get("roving.session", ""),
                               state=item.status.phase, reason=status.reason,
                               user=(item.metadata.labels or {}).get("roving.user", "")))
        return out

    def cancel_ids(self, job_ids: Iterable[str]) -> None:
        for job_id in job_ids:
            namespace, _, name = job_id.rpartition("/")
            if name.startswith("secret:"):
                self._delete_secret(name[len("secret:"):], namespace or None)
            else:
                self._delete(name, 0, namespace or None)

    def shutdown(self) -> None:
        with self._lock:
            live = [p for p in self._pods.values() if p.status.state is not JobState.EXITED]
        for pod in live:
            if pod.spec.output in ("prefix", "files") and pod.deleted_with is None:
                # its log as it is now, for its follower to print and ``_ended`` to write: once the pod is
                # deleted there is none to read (a pod whose process this one saw end may not have been
                # seen ended here yet: its last lines are in it)
                pod.output = self._read_log(pod.name) or pod.output
            self._delete(pod.name, 0)
            self._reaper.done(f"{self.namespace}/{pod.name}")
        with self._lock:
            left = list(self._secrets)
        for name in left:
            self._drop_pod_secret(name)
        # every pod has ended or was deleted just now: its follower reads the log once more, prints the
        # last lines and ends. It must end before the interpreter finalizes, or it is killed inside the
        # client's call (a daemon thread that wakes then is made to exit, and the forced unwind through
        # the client's compiled frames, pydantic-core's, aborts the whole process: exit code -6 after a
        # program that did all it should), and its last lines are lost.
        with self._lock:
            followers, self._followers = self._followers, []
        deadline = time.monotonic() + _TIMEOUT + 2 * _REFRESH_S
        for follower in followers:
            follower.join(max(0.0, deadline - time.monotonic()))


def _status_of(item: Any) -> JobStatus:
    """A pod's phase as roving's state: exit codes from the container's termination, reasons from conditions."""
    phase = item.status.phase
    terminated = None
    for cs in item.status.container_statuses or []:
        if cs.state and cs.state.terminated:
            terminated = cs.state.terminated
    if phase in ("Succeeded", "Failed") or terminated is not None:
        if terminated is None:
            return JobStatus(JobState.EXITED, 0 if phase == "Succeeded" else 1, phase)
        code = terminated.exit_code
        if terminated.signal:
            code = -terminated.signal
        elif 128 < code < 160:
            code = -(code - 128)
        return JobStatus(JobState.EXITED, code, f"{phase} {terminated.reason or ''}".strip(),
                         out_of_memory=terminated.reason == "OOMKilled")
    if phase == "Running":
        return JobStatus(JobState.RUNNING)
    reasons = [f"{c.reason}: {c.message}" for c in item.status.conditions or [] if c.status == "False" and c.reason]
    for cs in item.status.container_statuses or []:
        if cs.state and cs.state.waiting and cs.state.waiting.reason:
            reasons.append(f"{cs.state.waiting.reason}: {cs.state.waiting.message or ''}".strip())
    return JobStatus(JobState.PENDING, reason="; ".join(reasons) or (phase or "Pending"))


def _busy(exc: Exception) -> Optional[str]:
    """The API server's words when it refused for now: 429 (rate limit), 5xx but 501, or a quota
    conflict (403/409 "exceeded quota", which frees up as pods end); else None."""
    code = getattr(exc, "status", None)
    if not isinstance(code, int) or not code:
        return None
    words = _short(exc)
    if code == 429 or (code >= 500 and code != 501) or (code in (403, 409) and "quota" in words.lower()):
        return f"HTTP {code}: {words}"
    return None


def _short(exc: Exception) -> str:
    body = getattr(exc, "body", None)
    if body:
        try:
            return json.loads(body).get("message", str(body))
        except Exception:
            return str(body)[:300]
    return str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
