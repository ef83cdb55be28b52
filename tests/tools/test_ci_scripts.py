"""The CI script and the install/test scripts it calls: valid shell (shellcheck when
installed), the fast tier first, then what users install, then the README's test command,
and environments kept outside the clone."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from _server import REPO

SCRIPTS = [REPO / ".ci" / "run", *sorted((REPO / "scripts").glob("*.sh"))]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_are_valid_shell(script):
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True).returncode == 0
    shellcheck = shutil.which("shellcheck")
    if shellcheck:
        r = subprocess.run([shellcheck, str(script)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout


def test_ci_runs_the_fast_tier_first_then_the_wheel_then_the_readme_s_command():
    run = (REPO / ".ci" / "run").read_text()
    stages = [ln for ln in run.splitlines() if ln.startswith("stage ")]
    fast, wheel, rest = (next(i for i, ln in enumerate(stages) if s in ln)
                         for s in ('"not engine and not slow"', "scripts/wheel_check.sh", '"engine or slow"'))
    assert fast < wheel < rest
    assert "bash scripts/test.sh" in (REPO / "README.md").read_text()
    assert sum("bash scripts/test.sh" in ln for ln in stages) == 2
    assert "HSX_VENV=" in run and "HSX_COMPAT_VENVS=" in run  # reused between clones, stamped by what they install
    for script in ("install.sh", "compat.sh"):
        assert ".hsx-install" in (REPO / "scripts" / script).read_text()
