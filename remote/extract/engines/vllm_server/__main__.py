"""Runs :func:`remote.extract.engines.vllm_server.cli.main` for ``python -m remote.extract.engines.vllm_server``."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
