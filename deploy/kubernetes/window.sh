#!/usr/bin/env bash
# Shape 2: run hsx instead of production for a data-generation window.
#
#   deploy/kubernetes/window.sh -n llm-serving -p vllm-prod [-k deploy/kubernetes/overlays/instead-of] \
#       -- hsx extract --input data.jsonl --output /data/corpus
#
# 1. records production's replica count and scales it to zero (waits for its pods to go,
#    so their GPUs are free), 2. applies the hsx overlay and waits until hsx is ready,
# 3. runs the command after `--` with the hsx pods' addresses appended as --server flags
#    (no command: waits until Ctrl-C), then deletes hsx and scales production back, also
#    on error or Ctrl-C. The client resumes where it stopped if the window is cut short.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
namespace=""
production=""
overlay="${here}/overlays/instead-of"
timeout="45m"
while [[ $# -gt 0 ]]; do
    case "$1" in
        -n|--namespace) namespace="$2"; shift 2 ;;
        -p|--production) production="$2"; shift 2 ;;
        -k|--kustomize) overlay="$2"; shift 2 ;;
        -t|--timeout) timeout="$2"; shift 2 ;;
        --) shift; break ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "window.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
if [[ -z "$namespace" || -z "$production" ]]; then
    echo "window.sh: -n NAMESPACE and -p PRODUCTION_DEPLOYMENT are required" >&2
    exit 2
fi
k() { kubectl -n "$namespace" "$@"; }

replicas="$(k get deployment "$production" -o jsonpath='{.spec.replicas}')"
# shellcheck disable=SC2016  # a go-template, not shell
selector="$(k get deployment "$production" \
    -o go-template='{{range $k, $v := .spec.selector.matchLabels}}{{$k}}={{$v}},{{end}}')"
selector="${selector%,}"
echo "window.sh: production ${namespace}/${production} has ${replicas} replica(s); selector ${selector}"

restore() {
    status=$?
    trap - EXIT INT TERM
    echo "window.sh: removing hsx, scaling ${production} back to ${replicas}"
    kubectl kustomize "$overlay" | k delete --ignore-not-found --wait=true -f - || true
    k scale deployment "$production" --replicas="$replicas"
    k rollout status deployment "$production" --timeout="$timeout" || status=1
    exit "$status"
}
trap restore EXIT INT TERM

k scale deployment "$production" --replicas=0
k wait --for=delete pod -l "$selector" --timeout="$timeout" || true

kubectl kustomize "$overlay" | k apply -f -
k rollout status deployment hsx --timeout="$timeout"

if [[ $# -gt 0 ]]; then
    # shellcheck disable=SC2046  # one word per flag and address
    "$@" $("${here}/servers.sh" -n "$namespace")
else
    echo "window.sh: hsx is ready:" "$("${here}/servers.sh" -n "$namespace")"
    echo "window.sh: Ctrl-C ends the window and restores production"
    while true; do sleep 3600; done
fi
