"""Every shipped manifest that runs `hsx serve` gives it the time its stop may take.

After SIGTERM, `hsx serve` is gone within --shutdown-timeout + lifecycle.STOP_MARGIN
(tests/service/test_process_death.py measures it with an engine that no longer answers); an
orchestrator that kills sooner (terminationGracePeriodSeconds, compose's
stop_grace_period) would SIGKILL requests still draining. Offline: the manifests are
rendered by tests/tools/test_deploy.py's kustomize subset.
"""

from __future__ import annotations

import re

import pytest
import yaml

from hsx_service.lifecycle import STOP_MARGIN
from hsx_service.settings import ServiceSettings
from test_deploy import COMPOSE, K8S, KUSTOMIZATIONS, compose_env, container_env, effective_settings, interpolate, render

SERVING = (*KUSTOMIZATIONS, "jobs/extract")  # every kustomization whose pods run `hsx serve`
WORKLOADS = ("Deployment", "Job", "StatefulSet", "DaemonSet")
K8S_DEFAULT_GRACE = 30


def _serve_containers(docs: list[dict]):
    """(pod spec, container) for each container that runs `hsx serve`."""
    for d in docs:
        if d.get("kind") in WORKLOADS:
            pod = d["spec"]["template"]["spec"]
            for c in pod.get("initContainers", []) + pod["containers"]:  # a native sidecar is an init container
                words = " ".join(map(str, c.get("command", []) + c.get("args", [])))
                if c["name"] == "hsx" or "serve" in words.split():
                    yield pod, c


def test_every_manifest_running_hsx_serve_is_checked():
    """A new manifest (file) that runs `hsx serve` must be added to SERVING."""
    checked = {K8S / k for k in SERVING}
    for path in sorted(K8S.rglob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if isinstance(d, dict)]
        if any(True for _ in _serve_containers(docs)):
            assert any(path.parent == c or c in path.parents for c in checked), f"{path} runs hsx serve: add it to SERVING"


@pytest.mark.parametrize("kustomization", SERVING)
def test_grace_period_covers_drain_and_stop_margin(kustomization, monkeypatch):
    docs = render(K8S / kustomization)
    maps = {d["metadata"]["name"]: d.get("data", {}) for d in docs if d["kind"] == "ConfigMap"}
    found = list(_serve_containers(docs))
    assert found, f"{kustomization}: no hsx serve container"
    for pod, container in found:
        settings = effective_settings(ServiceSettings, monkeypatch, container_env(container, maps))
        grace = pod.get("terminationGracePeriodSeconds", K8S_DEFAULT_GRACE)
        assert grace >= settings.shutdown_timeout + STOP_MARGIN, (
            f"{kustomization}: terminationGracePeriodSeconds {grace} < HSX_SHUTDOWN_TIMEOUT "
            f"{settings.shutdown_timeout:g} + STOP_MARGIN {STOP_MARGIN:g}")


def _seconds(duration: str) -> float:
    """Compose durations: 120s, 2m, 1m30s."""
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def test_compose_stop_grace_period_covers_drain_and_stop_margin(monkeypatch):
    hsx = yaml.safe_load(COMPOSE.read_text())["services"]["hsx"]
    env = {k: interpolate(v) for k, v in compose_env(hsx).items() if k != "HSX_API_KEY"}
    settings = effective_settings(ServiceSettings, monkeypatch, env)
    grace = _seconds(hsx.get("stop_grace_period", "10s"))  # compose's default is 10 s
    assert grace >= settings.shutdown_timeout + STOP_MARGIN, (grace, settings.shutdown_timeout, STOP_MARGIN)


def test_the_docs_state_the_margin():
    from test_deploy import DOCS, ROOT

    margin = f"{STOP_MARGIN:g} s"
    readme = (ROOT / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `--shutdown-timeout`"))
    assert margin in row, row
    assert margin in DOCS.read_text()
