"""Settings → policy: load and merge the settings layers, parse the task override, resolve paths."""
