"""Developer tools kept in the checkout: no task of ``specops``, in no wheel, in no bundle but one.

``smoke_generator`` proves a patch set on the real speculators generator against HF and
vLLM references; ``bench_prefill`` times vLLM's own prefill as the baseline of
``scripts/bench_extract.py``; ``server_run`` runs the ``vllm-server`` engine alone on chosen
token ids and leaves a run dir ``specops verify`` reads. All start vLLM, so they run as
``python -m remote.dev.<name>`` in a host env's python with the checkout's root as the
working directory (or on ``PYTHONPATH``): the tests and scripts that use them run where the
checkout is. ``specops/transport/bundle.py`` (``DEV_ONLY``) and ``pyproject.toml`` keep them off hosts
and out of installs; nothing under ``remote/`` imports them.

One exception travels: ``faults`` (what an armed test hook does, :mod:`remote.run.faults`) is in
every bundle built from a checkout, so tests reach it on their hosts; it is in no wheel.
"""
