#!/usr/bin/env bash
# Magnitude on a kind cluster: build the images, install the chart, serve the CPU example,
# send one chat request through the Service. Needs Docker, kind, kubectl and helm.
# NOT run in this repository's CI (no Docker engine there); see README.md.
set -euo pipefail
cd "$(dirname "$0")/../.."

CLUSTER="${CLUSTER:-magnitude}"
TAG="${TAG:-dev}"
ENGINE_IMAGE="magnitude/engine:${TAG}"
OPERATOR_IMAGE="magnitude/operator:${TAG}"
ENGINE_DOCKERFILE="${ENGINE_DOCKERFILE:-Dockerfile.engine}"
OPERATOR_DOCKERFILE="${OPERATOR_DOCKERFILE:-Dockerfile.operator}"
EXAMPLE="${EXAMPLE:-examples/cpu-smollm2.yaml}"
NAMESPACE="${NAMESPACE:-default}"
LOCAL_PORT="${LOCAL_PORT:-18000}"

for tool in docker kind kubectl helm curl; do
  command -v "$tool" >/dev/null || { echo "run.sh: $tool is required" >&2; exit 2; }
done

kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER" --wait 120s
kubectl config use-context "kind-$CLUSTER"

docker build -t "$ENGINE_IMAGE" -f "$ENGINE_DOCKERFILE" .
docker build -t "$OPERATOR_IMAGE" -f "$OPERATOR_DOCKERFILE" .
kind load docker-image --name "$CLUSTER" "$ENGINE_IMAGE" "$OPERATOR_IMAGE"

helm upgrade --install magnitude charts/magnitude \
  --namespace magnitude-system --create-namespace \
  --set image.repository="${OPERATOR_IMAGE%:*}" --set image.tag="$TAG" --set image.pullPolicy=Never \
  --wait --timeout 5m

# The example names the released engine image; point it at the one just loaded.
NAME="$(kubectl apply --dry-run=client -f "$EXAMPLE" -o jsonpath='{.metadata.name}')"
kubectl apply -n "$NAMESPACE" -f "$EXAMPLE"
kubectl patch -n "$NAMESPACE" modelservice "$NAME" --type merge \
  -p "{\"spec\":{\"image\":\"$ENGINE_IMAGE\",\"imagePullPolicy\":\"Never\"}}"
kubectl wait -n "$NAMESPACE" --for=condition=Ready "modelservice/$NAME" --timeout=15m
kubectl get -n "$NAMESPACE" modelservice "$NAME"

kubectl port-forward -n "$NAMESPACE" "service/$NAME" "$LOCAL_PORT:8000" >/dev/null &
PF=$!
trap 'kill $PF' EXIT
for _ in $(seq 30); do curl -fsS "http://127.0.0.1:$LOCAL_PORT/readyz" >/dev/null 2>&1 && break; sleep 1; done
MODEL="$(curl -fsS "http://127.0.0.1:$LOCAL_PORT/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')"
curl -fsS "http://127.0.0.1:$LOCAL_PORT/v1/chat/completions" \
  -H 'Content-Type: application/json' \
  -d '{"model": "'"$MODEL"'", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16}'
echo
echo "run.sh: done. Delete the cluster with: kind delete cluster --name $CLUSTER"
