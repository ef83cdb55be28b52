#!/usr/bin/env bash
# Print one `--server URL` per ready hsx pod, for `hsx extract` to fan out over:
#   hsx extract $(deploy/kubernetes/servers.sh -n hsx) --input data.jsonl --output corpus/ ...
# or, with --csv, the comma-separated list the client also reads from HSX_SERVER:
#   export HSX_SERVER="$(deploy/kubernetes/servers.sh -n hsx --csv)"
# Run it again (or restart the client: it resumes) after scaling. From inside the cluster
# the headless Service's DNS name lists the same addresses: getent ahosts hsx-headless.NS.svc
set -euo pipefail

namespace=""
service="hsx-headless"
scheme="http"
csv=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        -n|--namespace) namespace="$2"; shift 2 ;;
        -s|--service) service="$2"; shift 2 ;;
        --https) scheme="https"; shift ;;
        --csv) csv=1; shift ;;
        -h|--help) sed -n '2,7p' "$0"; exit 0 ;;
        *) echo "servers.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
ns_args=()
[[ -n "$namespace" ]] && ns_args=(-n "$namespace")

# EndpointSlices list ready addresses and the port's number (the Service's targetPort).
kubectl get endpointslices "${ns_args[@]}" -l "kubernetes.io/service-name=${service}" \
    -o jsonpath='{range .items[*]}{range .endpoints[?(@.conditions.ready==true)]}{.addresses[0]}{" "}{end}{"|"}{.ports[0].port}{"\n"}{end}' |
while IFS='|' read -r addresses port; do
    for address in $addresses; do
        [[ "$address" == *:* ]] && address="[$address]"
        echo "${scheme}://${address}:${port}"
    done
done | {
    if [[ "$csv" == 1 ]]; then
        paste -sd, -
    else
        while read -r url; do printf -- '--server %s ' "$url"; done
        echo
    fi
}
