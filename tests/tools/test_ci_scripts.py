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


def test_ci_runs_the_fast_tier_beside_the_wheel_check_then_the_readme_s_command():
    run = (REPO / ".ci" / "run").read_text()
    lines = run.splitlines()
    stages = [ln for ln in lines if ln.startswith("stage ")]
    # The wheel check starts (in the background) before the fast tier and is waited for before
    # the engine tiers (so a broken wheel ends the run within minutes; beside the engine tiers
    # it saved nothing, as they keep both cores busy); a failing fast tier stops the run
    # (set -e) and the check with it (trap).
    start_wheel, fast, wait_wheel, rest = (next(i for i, ln in enumerate(lines) if s in ln and not ln.startswith("#"))
                                           for s in ("bash scripts/wheel_check.sh", '"not engine and not slow"',
                                                     "stage \"wheel check", '"engine or slow"'))
    assert start_wheel < fast < wait_wheel < rest
    assert "set -euo pipefail" in run and "kill $wheel_job" in run
    assert "bash scripts/test.sh" in (REPO / "README.md").read_text()
    assert sum("bash scripts/test.sh" in ln for ln in stages) == 2
    assert "export HSX_TEST_CLOCK=1" in run  # a run cut off by the limit names its slow and failed tests
    assert "HSX_VENV=" in run and "HSX_COMPAT_VENVS=" in run  # reused between clones, stamped by what they install
    for script in ("install.sh", "compat.sh"):
        assert ".hsx-install" in (REPO / "scripts" / script).read_text()


def test_every_environment_the_scripts_build_is_compiled_to_bytecode():
    """uv installs no bytecode; where processes may not write it (PYTHONDONTWRITEBYTECODE=1),
    every engine start compiled torch and vLLM from source in each of its processes."""
    assert "compileall" in (REPO / "scripts" / "venv_install.sh").read_text()
    for script in ("install.sh", "compat.sh"):
        text = (REPO / "scripts" / script).read_text()
        assert 'venv_compile "$venv"' in text.split('echo "$want" > "$stamp"')[0], script  # before the stamp
    assert "compileall" in (REPO / "scripts" / "test.sh").read_text()  # the checkout's own modules


def test_ci_builds_the_compat_environments_in_the_background_from_the_start():
    """A cold machine's compat environments were built inside the compat stages, one after the
    other, after the engine tiers; now they build beside the first stages and the compat stages
    wait for them."""
    lines = (REPO / ".ci" / "run").read_text().splitlines()
    at = {s: next(i for i, ln in enumerate(lines) if s in ln and not ln.lstrip().startswith("#"))
          for s in ("--install-only", '"not engine and not slow"', "stage \"compatibility environments",
                    'stage "compatibility check')}
    assert at["--install-only"] < at['"not engine and not slow"']
    assert at["stage \"compatibility environments"] < at['stage "compatibility check']
    compat = (REPO / "scripts" / "compat.sh").read_text()
    assert '= --install-only ] && exit 0' in compat
    for script in ("install.sh", "compat.sh"):  # uv where it can be had (scripts/venv_install.sh)
        assert ". scripts/venv_install.sh" in (REPO / "scripts" / script).read_text()
