"""kvmesh: a serving mesh for sliding-window + compressed-attention models.

Top-level package for what every service shares: the CLI, typed environment
settings, gRPC plumbing and the generated protobuf code. Services live under
`services/`, hot operations under `kernels/`.
"""

__version__ = "0.1.0"
