"""Developer tools that travel in the bundle but are no task of ``specops``.

``smoke_generator`` proves a patch set on the real speculators generator against HF and
vLLM references; ``bench_prefill`` times vLLM's own prefill as the baseline of
``scripts/bench_extract.py``; ``server_run`` runs the ``vllm-server`` engine alone on chosen
token ids and leaves a run dir ``specops verify`` reads. All start vLLM, so they run as ``python -m
remote.dev.<name>`` on a host, from the bundle dir; nothing under ``remote/`` imports them.
"""
