"""Local processes for the real backing servers (SeaweedFS S3, Valkey) and our services.

Used by test fixtures and by `kvmesh up`: each helper starts a real server
from a pip-installed binary on a loopback port and stops it cleanly.
"""
