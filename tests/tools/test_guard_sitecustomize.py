"""hsx's torch-extension guard reaches `hsx serve`'s child processes as a sitecustomize put
first on PYTHONPATH (hsx/compat.py). Python imports only the first sitecustomize it finds, so
the guard runs the one it shadows: a user's own, or the tests' fault injection (which the
engine processes had silently lost wherever the guard applied)."""

from __future__ import annotations

import os
import subprocess
import sys

from hsx.compat import GUARD_DIR, GUARD_ENV


def test_the_guard_runs_the_sitecustomize_it_shadows(tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['SHADOWED_RAN'] = 'yes'\n")
    env = {**os.environ, GUARD_ENV: "", "PYTHONPATH": os.pathsep.join([GUARD_DIR, str(tmp_path)])}
    r = subprocess.run([sys.executable, "-c", "import os, sitecustomize; print(sitecustomize.__file__, "
                        "os.environ.get('SHADOWED_RAN'))"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    origin, ran = r.stdout.split()
    assert os.path.dirname(origin) == os.path.abspath(GUARD_DIR) and ran == "yes", r.stdout


def test_without_another_sitecustomize_the_guard_runs_alone(tmp_path):
    env = {**os.environ, GUARD_ENV: "", "PYTHONPATH": GUARD_DIR}
    r = subprocess.run([sys.executable, "-c", "print('ok')"], env=env, capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
