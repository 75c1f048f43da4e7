"""The Kubernetes room: a task's sandbox as pods on a cluster.

- :mod:`.pod` — TaskSpec → Pod + NetworkPolicy, and what a Pod cannot express (pure; export's
  ``--format kube`` uses it too)
- :mod:`.agentsandbox` — the Pod as agent-sandbox's SandboxTemplate / SandboxWarmPool /
  SandboxClaim (pure)
- :mod:`.objects` — everything one task makes, in creation order (pure)
- :mod:`.rbac` — the least Role the executor needs (data)
- :mod:`.kubeconfig` — where the cluster is, found as kubectl finds it
- :mod:`.client` — a small JSON-over-HTTPS client of the API server, every call bounded
- :mod:`.facts` — what ``fusion-oci doctor`` says about the cluster
- :mod:`.netprobe` — whether the cluster enforces NetworkPolicy (a probe pod)

No runtime class is registered yet: the ``kubernetes`` backend id comes with the command path
(the exec agent over ``pods/exec``) and the worktree transfer.
"""
