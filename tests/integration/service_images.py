"""The service images (``images/postgres``, ``images/redis``) in an engine, for the service
container tests: built once per machine on the offline base (rootful podman when it answers,
then loaded into docker), as :mod:`tests.integration.images_fixture` does for the node image.
The task later finds the same tag: the product's provisioning picks the offline base too
when the public one cannot be pulled. About 40 s for postgres from nothing; one image inspect
when present.
"""

from __future__ import annotations

import threading

from fusion_oci.images.provision import ProvisionedImage
from fusion_oci.images.spec import BASE_REF, resolve_image
from tests.backends import require
from tests.integration.images_fixture import _machine_lock, _reachable, _run_sync, provision

_cache: dict[tuple[str, str], ProvisionedImage] = {}
_guard = threading.Lock()


def ensure_service_image(engine: str, name: str) -> ProvisionedImage:
    """``images/NAME`` built on the offline base and present in ``engine`` (podman, docker)."""
    key = (engine, name)
    with _guard:
        if key in _cache:
            return _cache[key]
        client, why = _reachable(engine)
        require(engine, client is not None, why)
        assert client is not None
        ref = resolve_image(name, base=BASE_REF).ref
        with client:
            info = client.image(ref)
        if info is not None:
            _cache[key] = ProvisionedImage(ref, info.id, "present")
            return _cache[key]
        with _machine_lock():
            _cache[key] = _run_sync(lambda: provision(engine, name))
        return _cache[key]
