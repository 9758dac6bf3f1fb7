#!/usr/bin/env bash
# Stop the control plane started by e2e/up.sh (only processes it recorded, by pid).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" e2e/cluster.py down "$@"
