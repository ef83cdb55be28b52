#!/usr/bin/env bash
# Sharded extraction on Kubernetes, then the merge (docs/deploy.md, "Shards").
#
#   deploy/kubernetes/jobs/run.sh -n NAMESPACE [-i 60]
#
# 1. applies the volume (kept afterwards) and the extract Job (an Indexed Job, one pod
#    per shard), 2. waits until the Job is Complete (every index succeeded) or Failed
#    (exit 1: the merge is not started; the failed indexes are printed), 3. applies the
#    merge Job and waits for it. Every step is idempotent: after a disconnect, run it
#    again and it picks up the Jobs where they are. The corpus ends in /corpus/merged on
#    the hsx-corpus volume.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
namespace=""
interval=60
while [[ $# -gt 0 ]]; do
    case "$1" in
        -n|--namespace) namespace="$2"; shift 2 ;;
        -i|--interval) interval="$2"; shift 2 ;;
        -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
        *) echo "run.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
if [[ -z "$namespace" ]]; then
    echo "run.sh: -n NAMESPACE is required" >&2
    exit 2
fi
k() { kubectl -n "$namespace" "$@"; }

# Waits for a Job's terminal condition; returns 0 on Complete, 1 on Failed.
wait_job() {
    local job="$1" state
    while true; do
        state="$(k get job "$job" -o jsonpath='{.status.conditions[?(@.status=="True")].type}')"
        case " $state " in
            *" Complete "*) echo "run.sh: job ${job} is complete"; return 0 ;;
            *" Failed "*)
                echo "run.sh: job ${job} failed; failed indexes: $(k get job "$job" -o jsonpath='{.status.failedIndexes}')" >&2
                echo "run.sh: see kubectl -n ${namespace} logs -l job-name=${job} -c extract (or -c merge); fix, delete the job, run again" >&2
                return 1 ;;
        esac
        echo "run.sh: job ${job}: $(k get job "$job" -o jsonpath='{.status.succeeded}') succeeded, $(k get job "$job" -o jsonpath='{.status.active}') active"
        sleep "$interval"
    done
}

kubectl kustomize "${here}/volume" | k apply -f -
kubectl kustomize "${here}/extract" | k apply -f -
wait_job hsx-extract
kubectl kustomize "${here}/merge" | k apply -f -
wait_job hsx-merge
echo "run.sh: the merged corpus is in /corpus/merged on the hsx-corpus volume (namespace ${namespace})"
