"""The ``kubernetes`` runtime: a task's sandbox is a pod on the team's cluster.

prepare, once per task:

1. the cluster, found as kubectl finds it (:mod:`.kubeconfig`), and the namespace;
2. this build's tools ConfigMap (the exec agent, its stream relay, the transfer's remote
   side: :mod:`.tools`), made once per build and shared;
3. the task's NetworkPolicy, then its Pod (:func:`.pod.pod_manifest`, the same translation
   ``fusion-oci export --format kube`` uses), labelled with their owner for ``gc``;
4. the pod running (:func:`.taskpod.wait_running`);
5. two ``pods/exec`` streams kept open for the task's life: the exec agent's (through its
   relay, ``mux.py``: a stream cannot pass descriptors) and the worktree transfer's.

Per command: the host worktree is pushed (only what changed since the last exchange), the
spawn frame runs through the agent (timeout, abort, whole-tree kill, stdin, streaming, output
caps and end reasons exactly as on the local runtimes: the same agent keeps them), and the
command's changes are pulled back, checked as coming from a hostile side
(docs/worktree-sync.md). dispose closes both streams (the agent ends every tree) and deletes
what prepare made.

What a Pod cannot express is either enforced another way or refused at ``check``: rlimits are
the agent's per command; NetworkPolicy enforcement is not readable from the API, so prepare
probes it once per cluster (:mod:`.netprobe`) and fails closed; ``egress`` needs the nodes'
networks (``kubernetes.nodeNetworks``); the bundle's seccomp profile needs a Localhost copy on
the nodes (``kubernetes.seccompProfile``); ``pidsLimit`` and a unix grant directly in a
system folder are refused (not carried to a pod).

``network: filtered`` (and ``credentials``): the task's egress proxy runs on the executor, as for
the local runtimes, and the pod reaches it back through the agent's stream: the relay listens
on the pod's 127.0.0.1:3128 (``mux.py --egress-listen``) and the streamed agent dials the
proxy's socket here for each connection. The pod's NetworkPolicy denies all egress, so a
command that ignores the proxy variables reaches nothing; no credential enters the cluster.

``services`` (per-task service containers): containers beside the task's in its pod
(:func:`.pod.pod_manifest`), on the pod's own loopback where the commands reach them directly;
prepare waits for their readiness probes (:func:`.taskpod.wait_services_ready`) and the pod's
deletion ends them with it.

``publishPorts``: the lifecycle listens on the executor's host port as for a local task, and
each client's connection is carried the other way over the agent's stream: the relay connects
to the pod's own 127.0.0.1:PORT, only for a port the pod was started with
(``mux.py --publish-port``), and the connection is audited as a local one
(:meth:`~fusion_oci.services.publish.TaskPorts.carry`).

``hostServices`` (TCP grants, any network): the same way back. The relay also listens on each
grant's address of the pod's loopback and the streamed agent dials that grant's relay here,
which connects to the granted address and audits the connection (:mod:`.hostservices`).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import hashlib
import json
import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fusion_oci.errors import EngineError, SandboxSetupError
from fusion_oci.images.gates import ProvisionGate
from fusion_oci.models import NetworkMode, RunOptions, RunResult
from fusion_oci.oci.model import ANN_RUN, User
from fusion_oci.policy.layout import CA_IN_SANDBOX
from fusion_oci.runtimes.kubernetes import taskpod
from fusion_oci.runtimes.kubernetes.agentsandbox import EXTENSIONS_API
from fusion_oci.runtimes.kubernetes.client import KubeClient, retrying
from fusion_oci.runtimes.kubernetes.facts import served_sandbox_apis
from fusion_oci.runtimes.kubernetes.hostservices import (
    listened,
    listener_table,
    pod_mux_argv,
    published_ports,
    unix_refusals,
)
from fusion_oci.runtimes.kubernetes.kubeconfig import ClusterAccess, find_access
from fusion_oci.runtimes.kubernetes.netprobe import probe_network_policy
from fusion_oci.runtimes.kubernetes.objects import Mode, TaskObjects, task_objects
from fusion_oci.runtimes.kubernetes.pod import PodService, pod_grants, writable_folders
from fusion_oci.runtimes.kubernetes.provision import ensure_shape
from fusion_oci.runtimes.kubernetes.sync.host import PullReport
from fusion_oci.runtimes.kubernetes.tools import (
    AGENT,
    MUX,
    REMOTE,
    Tools,
    host_ca,
    load_tools,
    path,
)
from fusion_oci.runtimes.linux.egress import proxy_socket
from fusion_oci.runtimes.outcome import LimitCounters, classify
from fusion_oci.runtimes.plans import AgentPlan, Plan, SandboxLaunch, own_plan, spawn_of
from fusion_oci.runtimes.protocol import Availability
from fusion_oci.runtimes.requirements import Requirement
from fusion_oci.runtimes.skeleton import SpecRuntime

if TYPE_CHECKING:
    from fusion_oci.agent.streamed import StreamedAgent
    from fusion_oci.oci.model import ProcessSpec, TaskSpec
    from fusion_oci.resolve import ResolvedTask
    from fusion_oci.runtimes.kubernetes.execstream import ExecStream
    from fusion_oci.runtimes.kubernetes.sync import WorktreeSync

POLICY_TTL_S = 24 * 3600.0
POD_UID = 1000
"""The pod's user when the executor runs as root."""
MUX_ARGV = ["python3", "-S", "-E", "-s", path(MUX), "--agent", path(AGENT)]
"""The exec agent's stream relay in the pod (stdlib only), which starts the agent itself;
a task's own adds its listeners (:func:`.hostservices.pod_mux_argv`)."""
HOLD = ["sleep", "infinity"]
"""The pod's own process: it only keeps the pod up. Commands run under the exec agent, which
the agent stream starts (an exec'd process is a child of the container runtime, not of it)."""

ENFORCED = frozenset(
    {
        # the pod's own root (read-only) and volumes; nothing of the executor's host
        Requirement.FILESYSTEM,
        # procMount Default: the container runtime masks the same /proc and /sys paths
        # (containerd's and CRI-O's defaults are the OCI list the bundle carries)
        Requirement.PROC_PATHS,
        # another machine's pid namespace: no process of the executor is visible
        Requirement.HOST_PROCESSES,
        Requirement.ENV,
        Requirement.NETWORK_NONE,
        # the pod's NetworkPolicy denies all egress; its only way out is the relay's
        # 127.0.0.1:3128, carried back to the task's proxy on the executor (PROTOCOL.md)
        Requirement.NETWORK_FILTERED,
        # TCP grants: the relay's listener on the pod's loopback, carried back over the
        # stream to the grant's relay on the executor (unix grants: refused in check)
        Requirement.HOST_SERVICES,
        # each client of the executor's published port carried over the stream to the pod's
        # own 127.0.0.1:PORT (mux.py --publish-port)
        Requirement.PUBLISHED_PORTS,
        Requirement.MEMORY,
        Requirement.CPU_QUOTA,
        Requirement.CPU_TIME,  # rlimits: the agent's setrlimit per command
        Requirement.FILE_SIZE,
        Requirement.TMP_SIZE,  # a memory emptyDir's sizeLimit is its tmpfs size
    }
)


def pod_services(spec: TaskSpec, env: Mapping[str, str]) -> tuple[PodService, ...]:
    """The spec's service containers with the images the nodes run them from (see
    :meth:`KubernetesRuntime._services`); ``export --format kube`` uses it too."""
    from fusion_oci.images.provision import default_image_ref

    named = dict(spec.service_containers)
    out = []
    for svc in spec.service_definitions:
        if named.get(svc.name) != svc.port:
            continue
        image = svc.image
        if "/" not in image and ":" not in image:
            ref = default_image_ref(image, env=env)
            out.append(PodService(svc, ref, pull_policy="Never"))
        else:
            out.append(PodService(svc, image))
    return tuple(out)


class KubernetesRuntime(SpecRuntime):
    id = "kubernetes"
    streams_stdin = True
    shares_host_files = False
    runs_services = True  # containers in the task's pod

    def setup(self) -> None:
        self.kube = self.settings.kubernetes
        self._access: ClusterAccess | None = None
        self._client: KubeClient | None = None
        self._namespace = ""
        self._made: list[dict[str, Any]] = []
        self.claim_ms: float | None = None
        """sandbox mode: the claim's create until agent-sandbox said it is Ready (benchmarks)"""
        self._agent: StreamedAgent | None = None
        self._agent_stream: ExecStream | None = None
        self._sync: WorktreeSync | None = None
        self._sync_stream: ExecStream | None = None
        self._pod = ""
        self._mux_argv = MUX_ARGV
        self._image = ""
        self._oom_seen = 0
        self.services_started: tuple[dict[str, object], ...] = ()
        self._created_at = 0.0
        self._pod_services: tuple[PodService, ...] = ()

    def _cluster(self) -> tuple[ClusterAccess, KubeClient]:
        if self._client is None or self._access is None:
            access = find_access(self.kube, self.env)
            if access is None:
                raise SandboxSetupError(
                    "no Kubernetes cluster is configured",
                    "no kubeconfig (kubernetes.kubeconfig, KUBECONFIG, ~/.kube/config) and not "
                    "in a pod",
                    "set kubernetes.kubeconfig, or KUBECONFIG, to the team cluster's kubeconfig "
                    "(docs/kubernetes.md)",
                )
            self._access = access
            self._client = KubeClient(access, self.kube.request_timeout_s)
            self._namespace = access.namespace
        return self._access, self._client

    def availability(self) -> Availability:
        """A cluster is configured (the API server is asked at prepare, where an answer that
        does not come is retried: a cluster briefly away is not "unavailable")."""
        try:
            access, _client = self._cluster()
        except SandboxSetupError as exc:
            return Availability(False, exc.why, exc.hint)
        return Availability(
            True,
            rootless=True,
            details={"server": access.server, "namespace": access.namespace},
        )

    def enforces(self) -> frozenset[Requirement]:
        extra = {Requirement.NETWORK_EGRESS} if self.kube.node_networks else set()
        return ENFORCED | extra

    def check(self, task: ResolvedTask) -> list[str]:
        missing = super().check(task)
        if self.kube.seccomp_profile is None:
            missing.append(
                "seccomp: the bundle's profile is not on the nodes and RuntimeDefault is not "
                "it; set kubernetes.seccompProfile to a Localhost copy (docs/kubernetes.md)"
            )
        missing += unix_refusals(task.spec.host_services, writable_folders(task.spec))
        return sorted(missing)

    def adopt(self, task: ResolvedTask) -> None:
        super().adopt(task)
        self._mux_argv = pod_mux_argv(task.spec)
        # once per task, not in every command's plan (a recipe's name resolved to its build)
        self._pod_services = pod_services(task.spec, self.env)

    # -- the pod ------------------------------------------------------------------------------

    def _task_objects(
        self,
        spec: TaskSpec,
        name: str,
        image: str,
        tools: str | None,
        mode: Mode = "pods",
        ca: str | None = None,
    ) -> TaskObjects:
        from fusion_oci.engines.labels import LABEL_KIND, LABEL_TASK, current_owner

        assert self.layout is not None
        hold = self.process(HOLD, RunOptions())
        if hold.user.uid == 0:
            # Root on the executor's host is not root in the pod: a pod never runs as root
            # (`restricted` refuses it, and the pod's root would be the node's root).
            hold = hold.model_copy(update={"user": User(uid=POD_UID, gid=POD_UID)})
        # The pod's own process starts in /: the worktree does not exist until the first
        # push makes it (a working directory the container runtime made would be root's).
        hold = hold.model_copy(update={"cwd": "/"})
        worktree = self.layout.worktree
        # The pod's repository is the transfer's own (a plain clone-like repo in the
        # worktree); the host's git folders are neither mounted nor wanted there.
        git_dirs = frozenset(
            m.destination
            for m in spec.mounts
            if m.destination != worktree
            and m.type == "bind"
            and not m.destination.startswith(worktree.rstrip("/") + "/")
            and "/.git" in m.destination
        )
        # The task's id under its own key: the pod's name is under io.fusion-oci/task (its
        # NetworkPolicy's selector), which an id under that key would have been overwritten by.
        labels = {LABEL_KIND: "pod", **current_owner().labels(), LABEL_TASK: spec.task_id}
        lifetime = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=self.kube.task_lifetime_s)
        return task_objects(
            spec,
            hold,
            self.kube,
            mode=mode,
            shutdown_time=lifetime.strftime("%Y-%m-%dT%H:%M:%SZ"),
            name=name,
            image=image,
            owner_labels=labels,
            # The worktree's parent is the pod's empty folder: the transfer makes the worktree
            # in it, owned by the pod's user (git refuses a repository in a folder another
            # user owns), and tasks whose worktrees share a parent share a shape.
            transferred=(str(Path(worktree).parent),),
            tools=tools,
            skip=git_dirs,
            files_from={CA_IN_SANDBOX: (ca, "host-ca.pem")} if ca else None,
            services=self._services(),
        )

    def _services(self) -> tuple[PodService, ...]:
        """The task's service containers as the spec defines them, with the images the nodes
        run them from: a recipe's name (``postgres``) is its content-hashed local name, which a
        cluster without a registry has imported (never pulled); a full reference is the
        nodes' to pull when they do not have it."""
        return self._pod_services

    def _image_ref(self, spec: TaskSpec) -> str:
        image = spec.image or ""
        if image and "/" not in image and ":" not in image:
            # a recipe under images/ (the default `node`): its content-hashed local name,
            # which is what a cluster without a registry has imported
            from fusion_oci.images.provision import default_image_ref

            assert self.layout is not None
            return default_image_ref(image, project_dir=Path(self.layout.worktree), env=self.env)
        if not image:
            raise SandboxSetupError(
                "the kubernetes runtime needs an image",
                "the task names none",
                "set sandbox.image to an image the cluster's nodes have",
            )
        return image

    async def prepare(self, task: ResolvedTask) -> ResolvedTask:
        task = await super().prepare(task)
        _access, client = self._cluster()
        spec = task.spec
        tools = load_tools()
        self._image = self._image_ref(spec)
        self._pod = f"fusion-oci-{spec.task_id[:20].lower().strip('-')}-{secrets.token_hex(4)}"
        self._pod = "".join(c if c.isalnum() or c == "-" else "-" for c in self._pod)
        ca_mount = next((m for m in spec.mounts if m.destination == CA_IN_SANDBOX), None)
        ca = host_ca(Path(ca_mount.source)) if ca_mount is not None and ca_mount.source else None
        try:
            # the first call, retried (tenacity) while the API server does not answer or is
            # busy; then the API error as it is (engine-error)
            await asyncio.to_thread(retrying, lambda: client.get("/version"))
            mode = await self._mode(client)
            objs = self._task_objects(
                spec, self._pod, self._image, tools.name, mode, ca.name if ca else None
            )
            if spec.network != NetworkMode.HOST:
                await self._check_policy_enforced(client, _access)
            await taskpod.ensure(client, tools.manifest(), self._namespace)
            if ca is not None:
                made = await taskpod.ensure(client, ca.manifest(), self._namespace)
                if made and task.layout.sentinels:
                    # credentials: the bundle holds the task's own broker CA, so no other
                    # task shares it: it goes with the task
                    self._made.append(ca.manifest())
            self._created_at = time.monotonic()
            if objs.sandbox is None:
                for obj in objs.manifests():
                    await taskpod.create(client, [obj], self._namespace)
                    self._made.append(obj)
            else:
                await ensure_shape(client, objs.sandbox, self._namespace, self._gate(task))
                claim = objs.sandbox.claim
                t_claim = time.perf_counter()
                (stored,) = await taskpod.create(client, [claim], self._namespace)
                self._made.append(claim)
                self._pod = await taskpod.wait_claimed(
                    client, self._namespace, self._pod, EXTENSIONS_API, self.kube.start_timeout_s,
                    str(stored.get("metadata", {}).get("resourceVersion") or ""),
                )  # fmt: skip
                self.claim_ms = (time.perf_counter() - t_claim) * 1000
            await taskpod.wait_running(
                client, self._namespace, self._pod, self.kube.start_timeout_s,
                f"that the nodes have the image {self._image}",
            )  # fmt: skip
            await self._wait_services(client)
            await self._open_streams(task, tools)
            self._oom_seen = await self._oom_kills() or 0
        except BaseException:
            await self._teardown()
            raise
        return task

    async def _wait_services(self, client: KubeClient) -> None:
        """Until each service container passed its readiness probe (the longest of their
        ``readyTimeoutS``); what the prepare event records of each."""
        services = self._services()
        if not services:
            return
        timeout = max(s.service.ready_timeout_s for s in services)
        await taskpod.wait_services_ready(
            client, self._namespace, self._pod, [s.container for s in services], timeout
        )
        # from the pod's (or the claim's) create to every service ready
        ready_ms = int((time.monotonic() - self._created_at) * 1000)
        self.services_started = tuple(
            {
                "name": s.service.name,
                "image": s.image,
                "container": f"{self._pod}/{s.container}",
                "port": s.service.port,
                "env_names": sorted(s.service.env) or None,
                "ready_ms": ready_ms,
            }
            for s in services
        )

    async def _mode(self, client: KubeClient) -> Mode:
        """``kubernetes.mode``, with ``auto`` asked of the cluster (agent-sandbox's APIs)."""
        if self.kube.mode == "pods":
            return "pods"
        served = await asyncio.to_thread(served_sandbox_apis, client)
        if all(served.values()):
            return "sandbox"
        if self.kube.mode == "sandbox":
            raise SandboxSetupError(
                "kubernetes.mode is sandbox but the cluster does not serve agent-sandbox",
                "missing: " + ", ".join(k for k, v in served.items() if not v),
                "install agent-sandbox v1.0+ on the cluster, or set kubernetes.mode: pods",
            )
        return "pods"

    def _gate(self, task: ResolvedTask) -> ProvisionGate:
        from fusion_oci.audit import AuditLog
        from fusion_oci.images.gates import AuditContext

        audit = self.audit if self.audit is not None else AuditLog()
        run_id = task.spec.annotations.get(ANN_RUN, "")
        ctx = AuditContext(audit, task.spec.task_id, run_id, backend=self.id)
        return ProvisionGate(self.settings.gates, ctx, self.ask)

    async def _open_streams(self, task: ResolvedTask, tools: Tools) -> None:
        from fusion_oci.agent.streamed import StreamedAgent
        from fusion_oci.runtimes.kubernetes.execstream import PodExec
        from fusion_oci.runtimes.kubernetes.sync import WorktreeSync, remote_argv
        from fusion_oci.services.handover import dial_spliced

        access, _client = self._cluster()
        assert self.layout is not None
        pods = PodExec(access, self.kube.request_timeout_s)
        proxy = proxy_socket(task)
        dialer = None
        if proxy is not None:
            dialer = functools.partial(asyncio.open_unix_connection, proxy)
        relays = task.services.sockets() if task.services is not None else None
        # Listener N of the pod's relay is the N-th grant: its relay here, fixed now. A TCP
        # grant's relay takes the handover's word first; a unix grant's relay is the socket
        # itself, spliced to the granted path.
        grants = pod_grants(task.spec)
        services = [
            functools.partial(
                dial_spliced if g.kind == "tcp" else asyncio.open_unix_connection, relay
            )
            for g, relay in zip(grants, listener_table(listened(grants), relays), strict=True)
        ]
        self._mux_argv = pod_mux_argv(task.spec)
        stream = await pods.open(self._namespace, self._pod, self._mux_argv, container="task")
        self._agent_stream = stream
        published = published_ports(task.spec)
        self._agent = await StreamedAgent.over(
            stream, timeout_s=30.0, egress=dialer, services=services, published=len(published)
        )
        if task.ports is not None:
            # the executor's listeners (bound by the lifecycle) hand each client to the stream
            await task.ports.carry(self._agent.inbound)
        worktree = self.layout.worktree
        self._sync_stream = await pods.open(
            self._namespace, self._pod, remote_argv(worktree, by_path=path(REMOTE)),
            container="task",
        )  # fmt: skip
        state = self.cache_root / "kubernetes" / "sync" / f"{task.spec.task_id}-{self._pod}"
        self._sync = WorktreeSync(Path(worktree), self._sync_stream, state, env=self.env)
        await self._sync.open()

    def plan(self, process: ProcessSpec) -> Plan:
        where = self._pod or "<pod>"
        return AgentPlan(
            backend=self.id,
            spawn=spawn_of(process),
            sandbox=SandboxLaunch(
                sdk_call="kubernetes pods/exec",
                sdk_kwargs={
                    "namespace": self._namespace or "<namespace>",
                    "pod": where,
                    "container": "task",
                    "command": self._mux_argv,
                    "image": self._image or "<image>",
                },
            ),
            notes=[
                "the task's pod on the cluster; the exec agent runs in it, reached over the API "
                "server (pods/exec) through its stream relay, one stream for the task",
                "before the command the host worktree's changes are pushed to the pod, after it "
                "the command's changes come back, checked (docs/worktree-sync.md)",
                *(
                    [
                        "host services: the relay listens on each grant's address (a unix "
                        "grant: its path) in the pod; each connection comes back over the "
                        "stream to the grant's relay here, which connects to the grant and "
                        "audits it"
                    ]
                    if "--service-listen" in self._mux_argv
                    else []
                ),
                *(
                    [
                        "services: containers beside the task's in its pod ("
                        + ", ".join(f"{s.container} {s.image}" for s in self._pod_services)
                        + "), on the pod's own loopback; ready by their readiness probes"
                    ]
                    if self._pod_services
                    else []
                ),
                *(
                    [
                        "published ports: each client of the host's port is carried over the "
                        "stream to the pod's own 127.0.0.1:PORT (mux.py --publish-port)"
                    ]
                    if "--publish-port" in self._mux_argv
                    else []
                ),
                process.shown_limits(),
            ],
            process=process,
        )

    async def execute(self, plan: Plan, opts: RunOptions) -> RunResult:
        own = own_plan(self, plan, AgentPlan)
        agent, sync = self._agent, self._sync
        if agent is None or sync is None or self.layout is None:
            raise SandboxSetupError(
                "runtime 'kubernetes' was not prepared",
                "its pod is not running",
                "call prepare(ctx) first",
            )
        await sync.push(dirs=_folders_for(own.spawn.cwd or "", self.layout.worktree))
        try:
            outcome = await agent.run_command(own.spawn, opts)
        except BaseException:
            # An aborted command's changes come back too: on a local runtime they are in the
            # worktree as it writes them. The agent ended its tree before this.
            with contextlib.suppress(Exception):
                await asyncio.shield(sync.pull())
            raise
        report = await sync.pull()
        counters = LimitCounters()
        if outcome.returncode != 0 or outcome.signal:
            counters = LimitCounters(oom_kills=await self._oom_kills_since())
        result = self.result(outcome, own.process, classify(outcome, own.process, counters))
        note = kept_out(report)
        if note:
            # The caller must learn what did not come back; stderr is where a command's
            # words about itself go (the agent's own setup errors go there too).
            result = result.model_copy(update={"stderr": result.stderr + note})
        return result

    async def _oom_kills_since(self) -> int:
        """The pod's OOM kills since the last look (its memory cgroup's ``oom_kill``, read in
        the pod through the agent): whether the memory limit ended a command."""
        seen = await self._oom_kills()
        if seen is None:
            return 0
        before, self._oom_seen = self._oom_seen, seen
        return max(0, seen - before)

    async def _oom_kills(self) -> int | None:
        if self._agent is None:
            return None
        process = self.process(["/bin/sh", "-c", OOM_COUNTER], RunOptions())
        try:
            out = await self._agent.run_command(
                spawn_of(process, env={"PATH": "/usr/bin:/bin"}), RunOptions(timeout_ms=10_000)
            )
        except Exception:
            return None
        return oom_kill_count(out.stdout.decode(errors="replace"))

    async def _check_policy_enforced(self, client: KubeClient, access: ClusterAccess) -> None:
        """NetworkPolicy is what keeps a pod's network to its policy; the API cannot say
        whether the cluster enforces it, so a probe does, once a day per cluster and
        namespace (its answer is kept in the cache folder). Not enforced, or unknown: the
        task is refused (fail closed)."""
        key = hashlib.sha256(f"{access.server}\0{self._namespace}".encode()).hexdigest()[:16]
        stamp = self.cache_root / "kubernetes" / f"netpolicy-{key}.json"
        with contextlib.suppress(OSError, ValueError):
            seen = json.loads(stamp.read_text())
            if seen.get("enforced") is True and time.time() - float(seen["at"]) < POLICY_TTL_S:
                return
        facts = await asyncio.to_thread(
            probe_network_policy, client, self._namespace, self._image, settings=self.kube
        )
        if facts.get("enforced") is None:
            raise EngineError(
                "could not find out whether the cluster enforces NetworkPolicy",
                str(facts.get("how", "unknown")),
                "see the probe's words above; `fusion-oci doctor` runs the same probe",
            )
        if facts.get("enforced") is not True:
            raise SandboxSetupError(
                "the cluster does not enforce NetworkPolicy",
                str(facts.get("how", "unknown")),
                "install a CNI plugin or enforcer that implements NetworkPolicy (Calico, "
                "Cilium, kube-router), or run tasks with network: host (no isolation)",
            )
        stamp.parent.mkdir(parents=True, exist_ok=True)
        tmp = stamp.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"enforced": True, "at": time.time()}))
        tmp.replace(stamp)

    async def _teardown(self) -> None:
        for closer in (self._agent, self._agent_stream, self._sync_stream):
            if closer is not None:
                with contextlib.suppress(Exception):
                    await closer.close()
        self._agent = self._agent_stream = self._sync_stream = None
        if self._sync is not None:
            with contextlib.suppress(Exception):
                await self._sync.close()
        self._sync = None
        if self._made and self._client is not None:
            made, self._made = self._made, []
            await taskpod.remove(self._client, made, self._namespace)

    async def dispose(self) -> None:
        try:
            await self._teardown()
        finally:
            if self._client is not None:
                self._client.close()  # its kept-alive connections
            await super().dispose()


OOM_COUNTER = (
    "cat /sys/fs/cgroup/memory.events 2>/dev/null || "
    "cat /sys/fs/cgroup/memory/memory.oom_control 2>/dev/null"
)
"""The container's memory cgroup's OOM kill counter: cgroup v2, else v1."""


def oom_kill_count(text: str) -> int | None:
    """``oom_kill N`` of memory.events / memory.oom_control. Pure."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None


def _folders_for(cwd: str, worktree: str) -> list[str]:
    """A command's working directory inside the worktree, relative, for the push (git does
    not carry an empty folder, so the remote may lack it). Pure."""
    root = worktree.rstrip("/")
    if cwd.startswith(root + "/"):
        return [cwd[len(root) + 1 :].rstrip("/")]
    return []


def kept_out(report: PullReport) -> str:
    """The lines a command's stderr gets for what its pull kept out of the host worktree. Pure."""
    lines = [
        f"fusion-oci: {p}: changed on the host during the command; the host's version stays "
        f"(the sandbox's is object {oid})"
        for p, oid in report.conflicts
    ]
    lines += [f"fusion-oci: {p}: not brought back: {why}" for p, why in report.refused]
    lines += [
        f"fusion-oci: {p}: a repository made in the sandbox stays there ({c})"
        for p, c in report.gitlinks
    ]
    if report.branch not in ("unchanged",) and not report.branch.startswith("updated"):
        lines.append(f"fusion-oci: the task branch was not moved: {report.branch}")
    return "".join(line + "\n" for line in lines)


__all__ = ["KubernetesRuntime", "kept_out"]
