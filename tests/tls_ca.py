"""A throwaway certificate authority for TLS tests: the one `kvmesh up` makes per run
(kvmesh/run_ca.py), valid for a day.

    ca = TestCA("kvmesh test CA")
    files = ca.issue(tmp_path, "mesh")     # TlsFiles: cert + key signed by ca, and ca.pem
"""

from __future__ import annotations

from kvmesh.run_ca import LocalCA


class TestCA(LocalCA):
    __test__ = False  # not a pytest class
