"""Code that runs on the GPU host.

Every module here imports only the standard library at import time; torch,
transformers, vllm and speculators are imported inside the function that needs
them, so the bundle runs in whatever python env the host uses.

A module that the controller calls as a task exposes ``main(params: dict) -> dict``
and returns ``remote.wire.protocol.payload(records, **data)``.
"""
