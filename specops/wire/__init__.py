"""The wire on the laptop: ``remote/wire/`` of this install, imported as an ordinary package.

The host imports the same files as ``remote.wire`` from the uploaded bundle. They import
only the standard library and each other (relative imports), so one copy of each rule
(the result records, the run contract, the argument spec, the manifest schema) serves both
sides. The package's path is the folder the install carries (:func:`specops.transport.assets.asset`):
the top-level ``remote/wire/`` in a checkout, ``specops/_assets/remote/wire/`` in a wheel.
"""
from specops.transport.assets import asset

__path__ = [str(asset("remote") / "wire")]

from . import argspec, contract, fsutil, layers, manifest, protocol, ranges, slurm, status, words  # noqa: E402  (after __path__)

__all__ = ["argspec", "contract", "fsutil", "layers", "manifest", "protocol", "ranges", "slurm", "status", "words"]
