"""The ``fusion-oci`` command line (typer + rich), imported lazily for a small start-up."""
