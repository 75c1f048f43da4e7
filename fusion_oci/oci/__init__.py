"""The one intermediate form: an OCI runtime-spec bundle (config.json [+ rootfs])."""
