"""The environment as a Kubernetes Pod and, unless it uses the host network, a
NetworkPolicy: the kubernetes runtime's own Pod mapping
(:func:`fusion_oci.runtimes.kubernetes.pod.pod_manifest`), with host paths as ``hostPath``
volumes (the file is played where the run's host paths are, e.g. by ``podman kube play``)."""

from __future__ import annotations

import os

import yaml

from fusion_oci.errors import BundleError
from fusion_oci.export.common import common_unexpressed, header
from fusion_oci.export.source import ExportSource
from fusion_oci.runtimes.kubernetes.pod import PodOptions, pod_manifest


def to_kube(src: ExportSource) -> tuple[str, list[str]]:
    if src.typed is None:
        raise BundleError(
            "the kube export needs the run's spec",
            "this ExportSource was built without one",
            "build it with fusion_oci.export.read_spec",
        )
    task, process = src.typed
    from fusion_oci.runtimes.kubernetes.runtime import pod_services

    opts = PodOptions(
        name=src.name,
        image=src.image,
        host_paths=True,
        files=frozenset(m.target for m in src.mounts if m.is_file),
        passed_env=frozenset(k for k, v in src.env.items() if v is None),
        skip=frozenset(src.skipped),
        annotations={
            **src.labels,
            **({"io.fusion-oci/image-digest": src.image_digest} if src.image_digest else {}),
        },
        # the spec's own definitions: a recipe's name is its local build's reference
        services=pod_services(task, os.environ),
    )
    mapping = pod_manifest(task, process, opts)
    # The mapping says the tmpfs and /proc gaps in a Pod's own terms: not twice.
    common = [
        m
        for m in common_unexpressed(src)
        if not m.startswith(("tmpfs ", "maskedPaths/readonlyPaths"))
    ]
    missing = [*common, *(g.text() for g in mapping.gaps)]
    docs = [mapping.pod] + ([mapping.network_policy] if mapping.network_policy else [])
    body = yaml.safe_dump_all(docs, sort_keys=False)
    return header(missing, "kube", src, "#") + body, missing
