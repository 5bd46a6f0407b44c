"""Launchers: the `kvmesh` command, `kvmesh up` and the processes it starts (the services,
Valkey, SeaweedFS). The top layer: launchers import services and kvmesh; nothing imports a
launcher (the import-linter contract in pyproject.toml)."""
