"""Issue 14's deployment files checked against each other and against the code, offline
(the checks of tests/tools/test_deploy.py, applied to the sharded run):

- deploy/kubernetes/jobs/{volume,extract,merge}: rendered, schema-validated (strict
  kubernetes-validate; kubectl kustomize agrees when installed); the extract Job is Indexed,
  one shard per pod, with `hsx serve` as a native sidecar whose settings, probes, GPUs and
  /dev/shm match the server, and a client whose flags parse with `hsx extract`'s own
  parser, which takes shard I of N from the pod's index and talks to 127.0.0.1 (leases);
  the merge Job's command parses with `hsx merge`'s parser and names every shard's output
  on the same ReadWriteMany volume; images pinned; no plain secrets (tests/tools/test_deploy.py's
  scan covers every file under deploy/);
- run.sh, deploy/slurm/*: shellcheck (tests/tools/test_deploy.py) and run here against fake
  kubectl / sbatch / hsx / curl: the merge starts only after every shard succeeded.
"""

from __future__ import annotations

import copy
import fnmatch
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from hsx_client.corpus.cli import build_extract_parser
from hsx_client.corpus.cli import build_merge_parser
from hsx_client.corpus.plan import ShardSpec
from hsx_client.settings import ClientSettings
from hsx_client.corpus.shard import resolve
from test_deploy import (  # noqa: F401  (fixtures are used by name)
    DEPLOY,
    DOCS,
    GPU,
    K8S,
    ROOT,
    SECRET_ENV,
    base_image,
    container_env,
    dockerfile,
    effective_settings,
    engine_gpus,
    env_names,
    fake_commands,
    kubectl_and_ours,
    one,
    public_paths,
    quantity_bytes,
    render,
    settings_cls,
    vllm_version_of,
)

JOBS = K8S / "jobs"
SLURM = DEPLOY / "slurm"
JOB_DIRS = ("volume", "extract", "merge")
INDEX_ANNOTATION = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def docs_of(name: str) -> list[dict]:
    return render(JOBS / name)


def the_kind(docs: list[dict], kind: str) -> dict:
    (d,) = [d for d in docs if d["kind"] == kind]
    return d


def configmaps(docs: list[dict]) -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of command and args."""
    return re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def mounts(container: dict) -> dict[str, str]:
    return {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}


def claim_mount(pod: dict, container: dict) -> tuple[str, str]:
    """(mount path, claim name) of the container's PersistentVolumeClaim."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    (hit,) = [(path, volumes[name]["persistentVolumeClaim"]["claimName"])
              for path, name in mounts(container).items() if "persistentVolumeClaim" in volumes[name]]
    return hit


@pytest.fixture(scope="module")
def extract_job():
    docs = docs_of("extract")
    job = the_kind(docs, "Job")
    pod = job["spec"]["template"]["spec"]
    (server,) = pod["initContainers"]
    (client,) = pod["containers"]
    return job, pod, server, client, configmaps(docs)


@pytest.fixture(scope="module")
def merge_job():
    job = the_kind(docs_of("merge"), "Job")
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    return job, pod, c


def client_env_names() -> set[str]:
    """HSX_* variables `hsx extract` reads: ClientSettings' fields and the shard count."""
    assert "HSX_NUM_SHARDS" in (ROOT / "client" / "corpus" / "shard.py").read_text()
    return {"HSX_" + name.upper() for name in ClientSettings.model_fields} | {"HSX_NUM_SHARDS"}


# --------------------------------------------------------------------------- schema and rendering
def test_job_manifests_pass_the_kubernetes_schema():
    kv = pytest.importorskip("kubernetes_validate", reason="offline schema validator: pip install kubernetes-validate")
    from kubernetes_validate.utils import latest_version

    version = latest_version()
    for name in JOB_DIRS:
        for doc in docs_of(name):
            kv.validate(doc, version, strict=True)
    bad = copy.deepcopy(the_kind(docs_of("extract"), "Job"))
    bad["spec"]["podFailurePolicy"]["rules"][0]["onExitCode"] = bad["spec"]["podFailurePolicy"]["rules"][0].pop("onExitCodes")
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, version, strict=True)


def test_kubectl_kustomize_agrees_for_the_jobs():
    for name in JOB_DIRS:
        theirs, ours = kubectl_and_ours(JOBS / name)
        for key, d in ours.items():
            if key[0] == "ConfigMap":
                assert theirs[key]["data"] == d["data"]
            if key[0] == "Job":
                tp, op = theirs[key]["spec"]["template"]["spec"], d["spec"]["template"]["spec"]
                for group in ("containers", "initContainers"):
                    for tc, oc in zip(tp.get(group, []), op.get(group, [])):
                        for field in ("image", "command", "args", "resources", "startupProbe", "restartPolicy"):
                            assert tc.get(field) == oc.get(field), (name, group, field)
                for field in ("completionMode", "completions", "parallelism", "backoffLimitPerIndex", "podFailurePolicy"):
                    assert theirs[key]["spec"].get(field) == d["spec"].get(field), (name, field)


# --------------------------------------------------------------------------- the extract Job
def test_extract_job_is_indexed_one_shard_per_pod(extract_job):
    job, pod, server, client, maps = extract_job
    spec = job["spec"]
    n = int(maps["hsx-extract-config"]["HSX_NUM_SHARDS"])
    assert spec["completionMode"] == "Indexed" and spec["completions"] == n and spec["parallelism"] <= n
    assert pod["restartPolicy"] == "Never" and spec["backoffLimitPerIndex"] >= 1
    rules = spec["podFailurePolicy"]["rules"]
    refused = [r for r in rules if r["action"] == "FailIndex"]
    assert refused and refused[0]["onExitCodes"] == {"containerName": client["name"], "operator": "In", "values": [2]}, \
        "exit 2 (refused) must not be retried"
    assert any(r["action"] == "Ignore" and r["onPodConditions"][0]["type"] == "DisruptionTarget" for r in rules)


def test_server_sidecar_is_hsx_serve_as_deployed(extract_job, settings_cls, env_names, public_paths, monkeypatch):
    job, pod, server, client, maps = extract_job
    assert server["restartPolicy"] == "Always", "a native sidecar: stopped when the client is done, so pods complete"
    assert "command" not in server and "args" not in server, "keep the image's `hsx serve` entrypoint"
    env = container_env(server, maps)
    assert set(n for n in env if n.startswith("HSX_")) <= env_names
    settings = effective_settings(settings_cls, monkeypatch, env)
    assert settings.host == "0.0.0.0", "the kubelet probes the pod IP"
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    assert ports == {"http": settings.port}
    assert int(job["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"]) == settings.port
    # the client starts once the sidecar's startupProbe passes: that must mean "serving"
    startup = server["startupProbe"]
    assert startup["httpGet"]["path"] == "/ready" and "/ready" in public_paths
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60
    assert server["livenessProbe"]["httpGet"]["path"] == "/health"
    for probe in (server["startupProbe"], server["livenessProbe"]):
        assert ports.get(probe["httpGet"]["port"], probe["httpGet"]["port"]) == settings.port
    assert pod["terminationGracePeriodSeconds"] > settings.shutdown_timeout + 15
    res = server["resources"]
    gpus = int(res["limits"][GPU])
    assert int(res["requests"][GPU]) == gpus == engine_gpus(shlex.split(env.get("HSX_ENGINE_ARGS", "")))
    volumes = {v["name"]: v for v in pod["volumes"]}
    shm = volumes[mounts(server)[settings.shm_dir]]["emptyDir"]
    assert shm["medium"] == "Memory" and quantity_bytes(shm["sizeLimit"]) >= settings.arena_bytes + 2**30
    assert quantity_bytes(res["limits"]["memory"]) >= quantity_bytes(shm["sizeLimit"]) + 16 * 2**30
    key = {v["name"]: v for v in server["env"]}["HSX_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert not key.get("optional", False)


def test_client_extracts_its_shard_from_the_server_in_its_pod(extract_job, dockerfile):
    job, pod, server, client, maps = extract_job
    assert client["command"] == ["hsx", "extract"]
    env = container_env(client, maps)
    assert {n for n in env if n.startswith("HSX_")} <= client_env_names()
    server_port = server["ports"][0]["containerPort"]
    assert env["HSX_SERVER"] == f"http://127.0.0.1:{server_port}", "the pod's own server: same network namespace, leases"
    literal = {v["name"]: v for v in client["env"]}
    assert literal["JOB_COMPLETION_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == INDEX_ANNOTATION
    assert literal["HSX_API_KEY"]["valueFrom"]["secretKeyRef"] == \
        {v["name"]: v for v in server["env"]}["HSX_API_KEY"]["valueFrom"]["secretKeyRef"]
    for var in client["env"]:
        assert not (SECRET_ENV.search(var["name"]) and "value" in var)
    corpus_mount, claim = claim_mount(pod, client)
    n = job["spec"]["completions"]
    outputs = set()
    for i in range(n):
        pod_env = {**env, "JOB_COMPLETION_INDEX": str(i)}
        args = build_extract_parser().parse_args([expand(a, pod_env) for a in client["args"]])
        assert resolve(args.shard, args.num_shards, pod_env) == ShardSpec(i, n)
        for path in (args.output, *args.inputs):
            assert Path(path).is_relative_to(corpus_mount), f"{path} is not on the shared volume"
        outputs.add(str(args.output))
    assert len(outputs) == n, "every shard needs its own directory"
    uid = int(one(dockerfile, "USER").split(":")[0])
    assert pod["securityContext"]["runAsUser"] == uid, "one uid: the lease socket's rule without a key"
    for c in (server, client):
        assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_merge_job_merges_every_shard_on_the_same_volume(extract_job, merge_job):
    job, pod, server, client, maps = extract_job
    mjob, mpod, merge = merge_job
    assert mpod["restartPolicy"] == "Never" and mjob["spec"]["backoffLimit"] >= 1
    (rule,) = [r for r in mjob["spec"]["podFailurePolicy"]["rules"] if r["action"] == "FailJob"]
    assert rule["onExitCodes"]["values"] == [2] and rule["onExitCodes"]["containerName"] == merge["name"]
    assert GPU not in merge["resources"].get("limits", {}) and GPU not in merge["resources"].get("requests", {})
    assert claim_mount(mpod, merge) == claim_mount(pod, client), "the merge must see the shards' volume at the same path"
    sh, flag, script = merge["command"]
    assert (sh, flag) == ("sh", "-c")
    words = shlex.split(script)
    assert words[:3] == ["exec", "hsx", "merge"]
    args = build_merge_parser().parse_args(words[3:])
    (pattern,) = [str(p) for p in args.shards]
    env = container_env(client, maps)
    for i in range(job["spec"]["completions"]):
        out = build_extract_parser().parse_args([expand(a, {**env, "JOB_COMPLETION_INDEX": str(i)}) for a in client["args"]]).output
        assert fnmatch.fnmatch(str(out), pattern), f"{pattern} does not match shard {i}'s {out}"
    assert not fnmatch.fnmatch(str(args.out), pattern)
    assert Path(args.out).is_relative_to(claim_mount(mpod, merge)[0])


def test_the_volume_is_shared_read_write_many(extract_job, merge_job):
    pvc = the_kind(docs_of("volume"), "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"], "pods on many nodes write their shards at once"
    assert claim_mount(extract_job[1], extract_job[3])[1] == pvc["metadata"]["name"]
    assert all(d["kind"] == "PersistentVolumeClaim" for d in docs_of("volume"))
    for name in ("extract", "merge"):
        assert not [d for d in docs_of(name) if d["kind"] == "PersistentVolumeClaim"], \
            f"jobs/{name} must not own the volume (deleting the Job would delete the data)"


def test_job_images_are_pinned(base_image):
    major, minor, patch = vllm_version_of(base_image)
    for name in ("extract", "merge"):
        spec = the_kind(docs_of(name), "Job")["spec"]["template"]["spec"]
        for c in spec["containers"] + spec.get("initContainers", []):
            image_name, _, tag = c["image"].rpartition(":")
            assert image_name and tag not in ("", "latest") and f"vllm{major}.{minor}.{patch}" in tag, c["image"]


# --------------------------------------------------------------------------- run.sh
FAKE_KUBECTL = r"""#!/usr/bin/env bash
# Records every call; a Job's conditions come one per `get` from $STATES/<job> (last one sticks).
echo "$*" >> "$KUBECTL_LOG"
case "$*" in
    kustomize*) printf 'rendered: %s\n' "$(basename "$2")" ;;
    *"apply -f -"*) cat >> "$KUBECTL_LOG" ;;
    *"get job"*"conditions"*)
        job="$(echo "$*" | sed -E 's/.*get job ([^ ]+).*/\1/')"
        f="$STATES/$job"
        head -n 1 "$f"
        if [ "$(wc -l < "$f")" -gt 1 ]; then sed -i 1d "$f"; fi ;;
    *"failedIndexes"*) printf '2' ;;
    *) printf '1' ;;
esac
"""


@pytest.fixture
def kubectl_env(tmp_path):
    states = tmp_path / "states"
    states.mkdir()
    log = tmp_path / "kubectl.log"
    log.touch()
    env = {**fake_commands(tmp_path, {"kubectl": FAKE_KUBECTL}), "KUBECTL_LOG": str(log), "STATES": str(states)}
    return env, log, states


@pytest.mark.parametrize("extract_states, rc", [(["", "", "Complete"], 0), (["", "Failed"], 1)])
def test_run_sh_merges_only_after_every_shard_succeeded(kubectl_env, extract_states, rc):
    env, log, states = kubectl_env
    (states / "hsx-extract").write_text("\n".join(extract_states) + "\n")
    (states / "hsx-merge").write_text("\nComplete\n")
    result = subprocess.run([str(JOBS / "run.sh"), "-n", "ml", "-i", "0"], env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == rc, result.stdout + result.stderr
    calls = log.read_text().splitlines()
    applied = [c.split()[-1] for c in calls if c.startswith("rendered:")]  # what `apply -f -` read
    polls = [i for i, c in enumerate(calls) if "get job hsx-extract" in c and "conditions" in c]
    if rc == 0:
        assert applied == ["volume", "extract", "merge"]
        assert len(polls) == 3 and polls[-1] < calls.index("rendered: merge")
        assert "the merged corpus is in /corpus/merged" in result.stdout
    else:
        assert applied == ["volume", "extract"], "a failed extraction must not start the merge"
        assert "failed indexes: 2" in result.stderr
    assert all(c.startswith(("kustomize", "rendered:", "-n ml ")) for c in calls), calls


# --------------------------------------------------------------------------- Slurm
FAKE_SBATCH = r"""#!/usr/bin/env bash
echo "$*" >> "$SBATCH_LOG"
n=$(wc -l < "$SBATCH_LOG")
echo "$((1233 + n));cluster"
"""

FAKE_HSX = r"""#!/usr/bin/env bash
# serve: runs until SIGTERM; extract / merge: record their arguments and environment.
case "$1" in
    serve)
        echo "serve ${*:2} model=$HSX_MODEL" >> "$HSX_LOG"
        [ -n "${FAKE_SERVE_DIES:-}" ] && exit 1
        trap 'echo stopped >> "$HSX_LOG"; exit 0' TERM
        touch "$HSX_LOG.up"  # only now may curl say ready: its line is logged, its trap set
        while true; do sleep 0.05; done ;;
    extract)
        echo "extract ${*:2}" >> "$HSX_LOG"
        echo "shard-env ${SLURM_ARRAY_TASK_ID} ${HSX_NUM_SHARDS}" >> "$HSX_LOG"
        exit "${FAKE_EXTRACT_RC:-0}" ;;
    merge) echo "merge ${*:2}" >> "$HSX_LOG" ;;
esac
"""

FAKE_CURL = r"""#!/usr/bin/env bash
# Not ready on the first poll, ready after, once the fake server is up (on a loaded box
# the background `hsx serve` may not have run a line yet when the first polls come).
n=$(cat "$CURL_COUNT" 2>/dev/null || echo 0)
echo $((n + 1)) > "$CURL_COUNT"
[ -n "${FAKE_SERVE_DIES:-}" ] && exit 7
[ "$n" -ge 1 ] && [ -f "$HSX_LOG.up" ]
"""


@pytest.fixture
def slurm_env(tmp_path):
    env = fake_commands(tmp_path, {"sbatch": FAKE_SBATCH, "hsx": FAKE_HSX, "curl": FAKE_CURL})
    env = {k: v for k, v in env.items() if not k.startswith(("HSX_", "SLURM_"))}
    env.update(SBATCH_LOG=str(tmp_path / "sbatch.log"), HSX_LOG=str(tmp_path / "hsx.log"),
               CURL_COUNT=str(tmp_path / "curl.count"), HSX_READY_POLL="0")
    return env


def test_slurm_submit_chains_the_merge_after_the_whole_array(slurm_env, tmp_path):
    corpus = tmp_path / "corpus"
    extract_flags = ["--input", "/shared/data set.jsonl", "--format", "speculators", "--max-length", "8192"]
    r = subprocess.run([str(SLURM / "submit.sh"), "-n", "3", "-o", str(corpus), "--", *extract_flags],
                       env={**slurm_env, "HSX_MODEL": "org/model"}, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    first, second = (tmp_path / "sbatch.log").read_text().splitlines()
    assert "--array=0-2" in first and first.endswith("extract.sbatch") and "HSX_NUM_SHARDS=3" in first
    assert "--dependency=afterok:1234 " in second and second.endswith("merge.sbatch")
    assert f"HSX_CORPUS={corpus}" in first and f"HSX_CORPUS={corpus}" in second
    assert (corpus / "extract.args").read_bytes().split(b"\0")[:-1] == [a.encode() for a in extract_flags]
    assert "merge job 1235" in r.stdout
    missing = subprocess.run([str(SLURM / "submit.sh"), "-n", "3", "-o", str(corpus), "--", "--input", "x"],
                             env=slurm_env, capture_output=True, text=True, timeout=30)
    assert missing.returncode == 2 and "HSX_MODEL" in missing.stderr


@pytest.mark.parametrize("extract_rc", [0, 3])
def test_slurm_task_serves_extracts_its_shard_then_stops_the_server(slurm_env, tmp_path, extract_rc):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    flags = ["--input", "/shared/data set.jsonl", "--format", "specforge"]
    (corpus / "extract.args").write_bytes(b"".join(a.encode() + b"\0" for a in flags))
    env = {**slurm_env, "HSX_CORPUS": str(corpus), "HSX_MODEL": "org/model", "SLURM_ARRAY_TASK_ID": "1",
           "HSX_NUM_SHARDS": "3", "FAKE_EXTRACT_RC": str(extract_rc)}
    r = subprocess.run(["bash", str(SLURM / "extract.sbatch")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == extract_rc, r.stderr
    serve, extract, shard_env, stopped = (tmp_path / "hsx.log").read_text().splitlines()
    m = re.fullmatch(r"serve --host 127\.0\.0\.1 --port (\d+) model=org/model", serve)
    assert m, serve
    assert extract.startswith(f"extract --server http://127.0.0.1:{m.group(1)} --output {corpus}/shards/shard-1 ")
    assert extract.endswith(" ".join(flags))
    assert shard_env == "shard-env 1 3" and resolve(None, None, {"SLURM_ARRAY_TASK_ID": "1", "HSX_NUM_SHARDS": "3"}) \
        == ShardSpec(1, 3)
    assert stopped == "stopped", "the server must be stopped when the task ends"


def test_slurm_task_fails_when_the_server_dies_before_ready(slurm_env, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "extract.args").write_bytes(b"--input\0x\0")
    env = {**slurm_env, "HSX_CORPUS": str(corpus), "HSX_MODEL": "m", "SLURM_ARRAY_TASK_ID": "0", "FAKE_SERVE_DIES": "1"}
    r = subprocess.run(["bash", str(SLURM / "extract.sbatch")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "exited before it was ready" in r.stderr
    assert "extract" not in (tmp_path / "hsx.log").read_text()


def test_slurm_merge_task_names_every_shard(slurm_env, tmp_path):
    corpus = tmp_path / "corpus"
    for i in range(3):
        (corpus / "shards" / f"shard-{i}").mkdir(parents=True)
    r = subprocess.run(["bash", str(SLURM / "merge.sbatch")], env={**slurm_env, "HSX_CORPUS": str(corpus)},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    (line,) = (tmp_path / "hsx.log").read_text().splitlines()
    args = build_merge_parser().parse_args(line.split()[1:])
    assert args.out == corpus / "merged" and args.shards == [corpus / "shards" / f"shard-{i}" for i in range(3)]


FAKE_NODE_HSX = r"""#!/usr/bin/env bash
# One node of the walkthrough on this host: `hsx serve` stands in for the node's server (the
# test's real one is at $REAL_SERVER) and runs until SIGTERM; extract and merge are the real
# `hsx`, extract pointed at the real server.
case "$1" in
    serve)
        trap 'exit 0' TERM
        touch "$HSX_LOG.up"
        while true; do sleep 0.05; done ;;
    extract)
        shift
        args=()
        while [ $# -gt 0 ]; do
            if [ "$1" = --server ]; then args+=(--server "$REAL_SERVER"); shift 2; else args+=("$1"); shift; fi
        done
        exec "$HSX_PYTHON" -m hsx_tools.cli extract "${args[@]}" ;;
    merge) shift; exec "$HSX_PYTHON" -m hsx_tools.cli merge "$@" ;;
esac
"""


@pytest.mark.engine
@pytest.mark.fixtures
@pytest.mark.slow
def test_slurm_walkthrough_with_real_shards_that_drop_samples(e2e_pool, tmp_path):
    """submit.sh's files run for real (sbatch faked): three array tasks extract their shards
    of the OASST fixture with the real client against a real server, at a max length that
    drops samples in every shard (issue 25 item 1: the merge refused such shards), then
    merge.sbatch's `hsx merge` makes one verified corpus of them."""
    import json
    import sys

    from _e2e_helpers import assert_verify_ok, cli_env
    from _server import CHAT

    (server,) = e2e_pool.get(1)
    env = fake_commands(tmp_path, {"sbatch": FAKE_SBATCH, "hsx": FAKE_NODE_HSX, "curl": FAKE_CURL})
    env = {k: v for k, v in env.items() if not k.startswith(("HSX_", "SLURM_"))}
    env.update({k: v for k, v in cli_env().items() if k.startswith("VLLM_")}, REAL_SERVER=server.url,
               HSX_PYTHON=sys.executable, SBATCH_LOG=str(tmp_path / "sbatch.log"), HSX_LOG=str(tmp_path / "hsx.log"),
               CURL_COUNT=str(tmp_path / "curl.count"), HSX_READY_POLL="0", HSX_MODEL="stories260K")
    corpus = tmp_path / "corpus"
    flags = ["--input", str(CHAT / "oasst" / "threads.messages.jsonl"), "--format", "speculators",
             "--max-length", "500", "--max-samples", "24", "--seed", "3"]
    r = subprocess.run([str(SLURM / "submit.sh"), "-n", "3", "-o", str(corpus), "--", *flags], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    dropped = 0
    for task in range(3):  # what Slurm runs for the array, one task after the other here
        (tmp_path / "curl.count").unlink(missing_ok=True)
        r = subprocess.run(["bash", str(SLURM / "extract.sbatch")], capture_output=True, text=True, timeout=400,
                           env={**env, "HSX_CORPUS": str(corpus), "SLURM_ARRAY_TASK_ID": str(task), "HSX_NUM_SHARDS": "3"})
        assert r.returncode == 0, r.stderr[-3000:]
        summary = json.loads(r.stdout)
        assert summary["status"] == "complete" and summary["dropped"] > 0, summary
        dropped += summary["dropped"]
    r = subprocess.run(["bash", str(SLURM / "merge.sbatch")], env={**env, "HSX_CORPUS": str(corpus)},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    merged = json.loads(r.stdout)
    assert merged["shards"] == 3 and merged["samples"] == 24 - dropped and merged["dropped_in_shards"] == dropped
    assert_verify_ok(corpus / "merged")


# --------------------------------------------------------------------------- docs
def test_runbook_covers_the_sharded_run():
    text = DOCS.read_text()
    for needle in ("jobs/volume", "jobs/extract", "jobs/merge", "jobs/run.sh", "deploy/slurm/submit.sh",
                   "extract.sbatch", "merge.sbatch", "hsx merge", "--shard", "JOB_COMPLETION_INDEX",
                   "SLURM_ARRAY_TASK_ID", "HSX_NUM_SHARDS", "ReadWriteMany", "native sidecar", "hard link"):
        assert needle in text, f"docs/deploy.md does not mention {needle}"
