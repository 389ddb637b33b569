"""What both sides agree on: stdlib only, relative imports only.

The host imports it as ``remote.wire``; the laptop as ``specops.wire`` (specops/wire/__init__.py points its path here),
so one file of each holds the wire format, the run contract, the argument spec and the manifest schema.
"""
