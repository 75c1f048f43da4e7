"""The Kubernetes room: a task's sandbox as a pod on a cluster (``backend: kubernetes``).

- :mod:`.runtime` — the runtime: prepare makes the task's pod (or claims one), every command
  a spawn frame to the exec agent over one ``pods/exec`` stream, the worktree across
- :mod:`.pod` — TaskSpec → Pod + NetworkPolicy, and what a Pod cannot express (pure; export's
  ``--format kube`` uses it too)
- :mod:`.agentsandbox` — the Pod as agent-sandbox's SandboxTemplate / SandboxWarmPool /
  SandboxClaim (pure)
- :mod:`.objects` — everything one task makes, in creation order (pure)
- :mod:`.tools` — the runtime's programs for the pod, one immutable ConfigMap per build
- :mod:`.taskpod` — the task's objects made, watched until the pod runs, removed
- :mod:`.execstream`, :mod:`.websocket` — ``pods/exec`` as an asyncio byte stream (stdlib)
- :mod:`.sync` — the worktree transfer (git objects over a stream, checked both ways)
- :mod:`.rbac` — the least Role the executor needs (data)
- :mod:`.kubeconfig` — where the cluster is, found as kubectl finds it
- :mod:`.client` — a small JSON-over-HTTPS client of the API server, every call bounded
- :mod:`.facts`, :mod:`.netprobe` — what ``fusion-oci doctor`` says; whether NetworkPolicy is
  enforced (a probe pod)
- :mod:`.provision` — a shape's template and pool, behind the ``sandbox_provision`` gate
- :mod:`.gc` — what a killed executor left in its namespace
"""
