#!/usr/bin/env bash
# Builds the e2e control plane from Go modules into e2e/.bin/ (ignored by git):
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok, plus helm (for the
# chart tests: `helm lint` / `helm template`).
# Versions are pinned by the small modules under e2e/go/ (go.mod + go.sum).
# A binary is rebuilt only when its module's go.mod/go.sum change (stamp file); Go's own
# caches (~/.cache/go-build, ~/go/pkg/mod) make a rebuild after a version bump incremental.
# Exit 3 (with a message) when no Go toolchain is installed, so callers can skip clearly.
set -euo pipefail
cd "$(dirname "$0")"
BIN="${MAGNITUDE_E2E_BIN:-$PWD/.bin}"
mkdir -p "$BIN/logs"

if ! command -v go >/dev/null 2>&1; then
  echo "e2e/build.sh: no Go toolchain on PATH; cannot build the e2e control plane" >&2
  exit 3
fi

export GOFLAGS="-trimpath -buildvcs=false -mod=readonly"
export GOTOOLCHAIN="${GOTOOLCHAIN:-local}"

# name  module-dir  package
TARGETS=(
  "etcd                    go/etcd        go.etcd.io/etcd/server/v3"
  "kwok                    go/kwok        sigs.k8s.io/kwok/cmd/kwok"
  "kube-apiserver          go/kubernetes  k8s.io/kubernetes/cmd/kube-apiserver"
  "kube-controller-manager go/kubernetes  k8s.io/kubernetes/cmd/kube-controller-manager"
  "kube-scheduler          go/kubernetes  k8s.io/kubernetes/cmd/kube-scheduler"
)

for target in "${TARGETS[@]}"; do
  read -r name dir pkg <<<"$target"
  stamp="$BIN/.$name.stamp"
  want="$(cat "$dir/go.mod" "$dir/go.sum" | sha256sum | cut -d' ' -f1)"
  if [[ -x "$BIN/$name" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    echo "e2e/build.sh: $name up to date"
    continue
  fi
  echo "e2e/build.sh: building $name ($pkg) ..."
  start=$(date +%s)
  # Two shared cores: build one binary at a time, at low priority.
  if ! (cd "$dir" && nice -n 10 go build -ldflags='-s -w' -o "$BIN/$name.tmp" "$pkg") >"$BIN/logs/build-$name.log" 2>&1; then
    echo "e2e/build.sh: building $name failed; see $BIN/logs/build-$name.log" >&2
    tail -20 "$BIN/logs/build-$name.log" >&2
    exit 1
  fi
  mv "$BIN/$name.tmp" "$BIN/$name"
  echo "$want" >"$stamp"
  echo "e2e/build.sh: built $name in $(( $(date +%s) - start ))s" | tee -a "$BIN/logs/build-times.log"
done

# helm: a released version straight from the Go module proxy (its own go.sum pins it).
HELM_VERSION="v3.16.4"
# What helm's own Makefile stamps in (from its client-go v0.31.3): without these the default
# Kubernetes version for `helm template` / `helm lint` is v1.20 and our chart (kubeVersion >= 1.29)
# is refused.
HELM_LDFLAGS="-s -w -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION"
for pkg in pkg/lint/rules pkg/chartutil; do
  HELM_LDFLAGS+=" -X helm.sh/helm/v3/$pkg.k8sVersionMajor=1 -X helm.sh/helm/v3/$pkg.k8sVersionMinor=31"
done
HELM_STAMP="$HELM_VERSION k8s-1.31"
if [[ -x "$BIN/helm" && -f "$BIN/.helm.stamp" && "$(cat "$BIN/.helm.stamp")" == "$HELM_STAMP" ]]; then
  echo "e2e/build.sh: helm up to date"
else
  echo "e2e/build.sh: building helm $HELM_VERSION ..."
  start=$(date +%s)
  if ! GOBIN="$BIN" GOFLAGS="-trimpath -buildvcs=false" nice -n 10 \
      go install -ldflags="$HELM_LDFLAGS" \
      "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" >"$BIN/logs/build-helm.log" 2>&1; then
    echo "e2e/build.sh: building helm failed; see $BIN/logs/build-helm.log" >&2
    tail -20 "$BIN/logs/build-helm.log" >&2
    exit 1
  fi
  echo "$HELM_STAMP" >"$BIN/.helm.stamp"
  echo "e2e/build.sh: built helm in $(( $(date +%s) - start ))s" | tee -a "$BIN/logs/build-times.log"
fi

# Prometheus and promtool: Debian's package (the distribution's build, pinned by version and
# sha256), unpacked without installing, for the tests whose subject is metrics, recording/alert
# rules or dashboard queries (`promtool test rules`, a real Prometheus scraping the engine).
PROM_DEB="prometheus_2.42.0+ds-5+deb12u1_amd64.deb"
PROM_SHA256="81d59a24fce84f7fbe97a45a4f2914b6a5881b5cd1db2a6a0e129e515e1a5f55"
if [[ -x "$BIN/prometheus" && -x "$BIN/promtool" && -f "$BIN/.prometheus.stamp" && "$(cat "$BIN/.prometheus.stamp")" == "$PROM_SHA256" ]]; then
  echo "e2e/build.sh: prometheus up to date"
elif ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg >/dev/null 2>&1; then
  echo "e2e/build.sh: no apt-get/dpkg; the Prometheus tests will skip (or fail under CI=true)" >&2
else
  echo "e2e/build.sh: fetching $PROM_DEB ..."
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  version="${PROM_DEB#prometheus_}"; version="${version%_amd64.deb}"
  if ! (cd "$work" && chmod 777 . && apt-get download -q "prometheus=$version" >"$BIN/logs/fetch-prometheus.log" 2>&1); then
    (apt-get update -q >>"$BIN/logs/fetch-prometheus.log" 2>&1 || true)
    (cd "$work" && apt-get download -q "prometheus=$version" >>"$BIN/logs/fetch-prometheus.log" 2>&1) || {
      echo "e2e/build.sh: fetching prometheus failed; see $BIN/logs/fetch-prometheus.log" >&2; exit 1; }
  fi
  if [[ "$(sha256sum "$work/$PROM_DEB" | cut -d' ' -f1)" != "$PROM_SHA256" ]]; then
    echo "e2e/build.sh: $PROM_DEB does not match its pinned sha256" >&2
    exit 1
  fi
  dpkg -x "$work/$PROM_DEB" "$work/x"
  install -m 0755 "$work/x/usr/bin/prometheus" "$work/x/usr/bin/promtool" "$BIN/"
  echo "$PROM_SHA256" >"$BIN/.prometheus.stamp"
  echo "e2e/build.sh: prometheus and promtool in $BIN"
fi
