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

# Tests run on TEST_WORKERS processes (pytest-xdist): most of the suite waits on one core (ssh,
# a server's start, a rank's load), so two workers keep a 2-core box busy; tests that share
# one costly fixture stay on one worker (tests/conftest.py). TEST_WORKERS=0 runs in-process.
TEST_WORKERS ?= 2

test: bootstrap
	.venv/bin/python -m specops.testhost.sourcetree --quiet
	.venv/bin/python -m pytest -n $(TEST_WORKERS) --dist loadscope $(PYTEST_ARGS)

bench: bootstrap
	.venv/bin/specops testhost.up
	.venv/bin/python scripts/bench_preflight.py
	.venv/bin/python scripts/bench_extract.py
	.venv/bin/python scripts/bench_smoke.py
	.venv/bin/python scripts/bench_follow.py
	.venv/bin/python scripts/bench_states.py
	.venv/bin/python scripts/bench_digest.py
	.venv/bin/python scripts/bench_canary.py
	.venv/bin/python scripts/bench_canary.py --landing
