"""ART's script API on this machine: LocalBackend, RemoteBackend, `trajflow backend serve`."""
