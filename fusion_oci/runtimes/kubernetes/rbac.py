"""The least RBAC the executor needs in its namespace, as data: docs/kubernetes.md prints it,
``doctor`` checks each rule with a SelfSubjectAccessReview, the cluster tests bind a
ServiceAccount to exactly this Role. Pure.

Namespaced only: nothing cluster-wide. API discovery (which groups the cluster serves) and
the access reviews themselves are open to every authenticated identity by Kubernetes' own
``system:discovery`` and ``system:basic-user`` ClusterRoles.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ROLE_NAME = "fusion-oci-executor"


@dataclass(frozen=True)
class Rule:
    group: str
    resource: str
    verbs: tuple[str, ...]
    why: str

    def as_policy_rule(self) -> dict[str, Any]:
        return {"apiGroups": [self.group], "resources": [self.resource], "verbs": list(self.verbs)}


RULES: tuple[Rule, ...] = (
    Rule("", "pods", ("create", "get", "list", "watch", "delete"), "the task's pod (pods mode), "
         "the doctor's NetworkPolicy probe; list and watch: readiness, gc"),
    Rule("", "pods/exec", ("create", "get"), "commands through the exec agent"),
    Rule("", "pods/log", ("get",), "a service container's last lines when it does not start"),
    Rule("", "secrets", ("create", "get", "list", "delete"), "caller variables passed by name "
         "(the pod reads its Secret NAME-env); gc"),
    Rule("", "configmaps", ("create", "get", "list", "delete"), "the runtime's tools for the "
         "pod (one immutable ConfigMap per fusion-oci build, shared); gc"),
    Rule("networking.k8s.io", "networkpolicies", ("create", "get", "list", "delete"),
         "the pod's NetworkPolicy (pods mode), the doctor's probe policy; gc"),
    Rule("extensions.agents.x-k8s.io", "sandboxtemplates", ("create", "get", "list", "delete"),
         "one template per task shape (sandbox mode)"),
    Rule("extensions.agents.x-k8s.io", "sandboxwarmpools", ("create", "get", "list", "delete"),
         "the shape's warm pool (sandbox mode)"),
    Rule("extensions.agents.x-k8s.io", "sandboxclaims", ("create", "get", "list", "watch",
         "delete"), "one claim per task (sandbox mode); gc"),
    Rule("agents.x-k8s.io", "sandboxes", ("get", "list", "watch"), "the claimed sandbox's pod"),
)  # fmt: skip


def role(namespace: str, name: str = ROLE_NAME) -> dict[str, Any]:
    """The Role manifest. Pure."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": name, "namespace": namespace},
        "rules": [r.as_policy_rule() for r in RULES],
    }


def role_binding(namespace: str, service_account: str, name: str = ROLE_NAME) -> dict[str, Any]:
    """A RoleBinding of the Role to a ServiceAccount of the namespace. Pure."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": name, "namespace": namespace},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": service_account, "namespace": namespace}],
    }


def access_reviews(namespace: str) -> list[tuple[str, dict[str, Any]]]:
    """One SelfSubjectAccessReview per verb of every rule, with its ``verb group/resource``
    label. Pure."""
    out = []
    for rule in RULES:
        resource, _, sub = rule.resource.partition("/")
        for verb in rule.verbs:
            attrs = {"namespace": namespace, "verb": verb, "group": rule.group,
                     "resource": resource}  # fmt: skip
            if sub:
                attrs["subresource"] = sub
            label = f"{verb} {rule.group + '/' if rule.group else ''}{rule.resource}"
            out.append(
                (
                    label,
                    {
                        "apiVersion": "authorization.k8s.io/v1",
                        "kind": "SelfSubjectAccessReview",
                        "spec": {"resourceAttributes": attrs},
                    },
                )
            )
    return out
