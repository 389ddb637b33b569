# The two commands a newcomer needs (both install what they need first):
#   make demo   -- the main job on the built-in test hosts (seed stack, then modern stack) and tiny models
#   make test   -- the whole test suite
.PHONY: demo test bootstrap bench

bootstrap:
	@scripts/bootstrap.sh

demo: bootstrap
	.venv/bin/specops testhost.up
	.venv/bin/specops demo --on local
	.venv/bin/specops testhost.up --stack modern
	.venv/bin/specops demo --on modern

test: bootstrap
	.venv/bin/python -m pytest $(PYTEST_ARGS)

bench: bootstrap
	.venv/bin/specops testhost.up
	.venv/bin/python scripts/bench_preflight.py
	.venv/bin/python scripts/bench_extract.py
	.venv/bin/python scripts/bench_smoke.py
	.venv/bin/python scripts/bench_follow.py
