#!/usr/bin/env bash
# Start the local e2e control plane (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kwok) on loopback. Prints `export KUBECONFIG=...`; stop it with e2e/down.sh.
# Pods it runs stay fake unless something plays kubelet (the pytest suite does: e2e/kubelet.py).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-.venv/bin/python}" e2e/cluster.py up "$@"
