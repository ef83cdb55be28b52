#!/usr/bin/env bash
# Sharded extraction on Slurm, then the merge (docs/deploy.md, "Shards").
#
#   HSX_MODEL=Qwen/Qwen3-8B HSX_ENGINE_ARGS="--max-model-len 8192" \
#   deploy/slurm/submit.sh -n 8 -o /shared/corpus -- --input /shared/data.jsonl --format speculators
#
# Submits extract.sbatch as an array of N tasks (task I: `hsx serve` on its node and
# `hsx extract --shard I/N` against it, into CORPUS/shards/shard-I), then merge.sbatch
# with --dependency=afterok on the whole array (CORPUS/merged). The flags after `--` are
# the corpus flags every shard must share; they are saved in CORPUS/extract.args, so a
# task that is requeued or resubmitted uses exactly the same. Extra sbatch options: the
# SBATCH_* environment (SBATCH_PARTITION, SBATCH_ACCOUNT, ...) or edit the #SBATCH lines.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
shards=""
corpus=""
while [[ $# -gt 0 ]]; do
    case "$1" in
        -n|--shards) shards="$2"; shift 2 ;;
        -o|--corpus) corpus="$2"; shift 2 ;;
        --) shift; break ;;
        -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
        *) echo "submit.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
if [[ -z "$shards" || -z "$corpus" || $# -eq 0 ]]; then
    echo "submit.sh: -n SHARDS, -o CORPUS_DIR and the hsx extract flags after -- are required" >&2
    exit 2
fi
if [[ -z "${HSX_MODEL:-}" ]]; then
    echo "submit.sh: set HSX_MODEL (the model every node serves)" >&2
    exit 2
fi
mkdir -p "$corpus/shards" "$corpus/logs"
printf '%s\0' "$@" > "$corpus/extract.args"

array="$(sbatch --parsable --array="0-$((shards - 1))" --output="$corpus/logs/extract-%A_%a.out" \
    --export="ALL,HSX_CORPUS=${corpus},HSX_NUM_SHARDS=${shards}" "$here/extract.sbatch")"
array="${array%%;*}"
merge="$(sbatch --parsable --dependency="afterok:${array}" --kill-on-invalid-dep=yes \
    --output="$corpus/logs/merge-%j.out" --export="ALL,HSX_CORPUS=${corpus}" "$here/merge.sbatch")"
echo "submit.sh: extract array ${array} (${shards} shards), merge job ${merge%%;*} after it; corpus: ${corpus}/merged"
