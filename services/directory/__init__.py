"""Snapshot directory: which engine holds which SWA snapshot (see README.md)."""
