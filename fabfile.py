"""fab tasks for specops: thin; everything lives in the ``specops`` package.

    fab --list            # same tasks as `specops --list`
    fab facts --on testhost
"""
from specops.tasks import ns  # noqa: F401  (invoke loads the collection named `ns`)
