"""The fast tier stays free of engines: conftest.py fails a test that starts `hsx serve`,
or uses a fixture that did, without `@pytest.mark.engine` (run in a pytest of its own)."""

from __future__ import annotations

import re
from pathlib import Path

pytest_plugins = ["pytester"]

HERE = Path(__file__).resolve().parents[1]  # tests/: conftest.py and _server.py

CASES = '''
import pytest
from _server import EngineGuard, ServerProcess


@pytest.fixture(scope="module")
def server_like():
    EngineGuard.starting_a_server()  # what ServerProcess does before it starts anything
    yield "a server"


@pytest.mark.engine
def test_marked_user(server_like):
    pass


def test_unmarked_user(server_like):
    pass


def test_starts_one_unmarked(tmp_path):
    ServerProcess("no-model", log_dir=tmp_path)  # refused before any process starts
'''


def _session(pytester):
    pytester.makeconftest((HERE / "conftest.py").read_text())
    pytester.makepyfile(_server=(HERE / "_server.py").read_text(), test_cases=CASES)
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\nmarkers =\n    engine: starts vLLM\n")


def test_a_test_using_a_server_without_the_engine_marker_fails(pytester):
    _session(pytester)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1, errors=1)
    result.stdout.fnmatch_lines([
        "*test_unmarked_user uses server_like (a vLLM engine) but is not marked @pytest.mark.engine*",
        "*test_starts_one_unmarked starts `hsx serve` (a vLLM engine) but is not marked @pytest.mark.engine*",
    ])


def test_the_fast_tier_refuses_the_first_unmarked_user_too(pytester):
    _session(pytester)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-m", "not engine")
    result.assert_outcomes(failed=1, errors=1)  # the fixture now starts in the unmarked test



# Appended to conftest.py in the pytester session: the real SHARED_SERVERS name, no engine.
POOL_STANDIN = '''

@pytest.fixture(scope="session")
def e2e_pool():
    EngineGuard.starting_a_server()
    yield "the shared pool"
'''

# The same, counted in the run's engine census as a real server is (in a subprocess only: an
# in-process run would add it to this process's census).
COUNTED_POOL = POOL_STANDIN.replace(
    "    yield", "    from _server import ENGINE_STARTS, EngineStart\n"
    "    ENGINE_STARTS.append(EngineStart('pool', 'e2e_pool', seconds=1.5))\n    yield")

GROUPS = '''
import pytest
from _server import EngineGuard


@pytest.fixture(scope="session")
def unlisted_server():
    EngineGuard.starting_a_server()
    yield "a session server conftest.py does not know"


@pytest.mark.engine
def test_pool_user(e2e_pool, request):
    print("GROUP", request.node.get_closest_marker("xdist_group").args[0])


@pytest.mark.engine
def test_own(request):
    print("GROUP", request.node.get_closest_marker("xdist_group").args[0])


@pytest.mark.engine
def test_unlisted(unlisted_server):
    pass
'''


def test_modules_sharing_a_session_server_share_a_group_and_an_unlisted_one_fails(pytester):
    _session(pytester)
    pytester.makeconftest((HERE / "conftest.py").read_text() + POOL_STANDIN)
    show = "    print('GROUP', request.node.get_closest_marker('xdist_group').args[0])\n"
    pytester.makepyfile(test_groups=GROUPS,
                        test_other=f"import pytest\n\n@pytest.mark.engine\ndef test_other_pool_user(e2e_pool, request):\n{show}",
                        test_alone=f"def test_alone(request):\n{show}")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-s", "test_groups.py", "test_other.py", "test_alone.py")
    result.assert_outcomes(passed=4, errors=1)
    out = result.stdout.str()
    # test_own joins its module's group; the module alone is a group of its own
    assert out.count("GROUP e2e_pool") == 3 and "GROUP test_alone.py" in out, out
    assert "the session-wide fixture unlisted_server starts an engine: list it in" in out


def test_under_xdist_a_group_runs_on_one_worker(pytester):
    """pytest-xdist reads the groups off renamed node ids (pytest 9.2 stopped reading those:
    every test then went its own way, and each worker started its own shared servers)."""
    _session(pytester)
    pytester.makeconftest((HERE / "conftest.py").read_text() + COUNTED_POOL)
    users = "".join(f"@pytest.mark.engine\ndef test_user_{i}(e2e_pool):\n    pass\n\n\n" for i in range(6))
    pytester.makepyfile(test_a=f"import pytest\n\n\n{users}", test_b=f"import pytest\n\n\n{users}")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup", "-v",
                                           "test_a.py", "test_b.py")
    result.assert_outcomes(passed=12)
    workers = {line.split()[0] for line in result.stdout.lines if "PASSED" in line and "test_user_" in line}
    assert len(workers) == 1, result.stdout.str()
    # the worker's engine starts reach the controller's census
    assert "engine starts: 1, 2 s until ready in all" in result.stdout.str(), result.stdout.str()


# A stand-in pool whose stop conftest.py calls when its group's last test ends.
STOPPING_POOL = '''

@pytest.fixture(scope="session")
def e2e_pool():
    EngineGuard.starting_a_server()
    GROUP_SERVERS.append(lambda: print("STOPPED"))
    yield "the shared pool"
'''


def test_a_groups_session_servers_stop_when_its_last_test_ends(pytester):
    """Not at the session's end: each group's engines are gone before the next group starts."""
    _session(pytester)
    pytester.makeconftest((HERE / "conftest.py").read_text() + STOPPING_POOL)
    users = "".join(f"@pytest.mark.engine\ndef test_user_{i}(e2e_pool):\n    print('USER {i}')\n\n\n" for i in range(2))
    pytester.makepyfile(test_a=f"import pytest\n\n\n{users}", test_b="def test_alone():\n    print('ALONE')\n")
    # one process, the modules' order interleaving the group: it still runs in one stretch
    pytester.makepyfile(test_c="import pytest\n\n\n@pytest.mark.engine\ndef test_late_user(e2e_pool):\n    print('USER 2')\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-s", "test_a.py", "test_b.py", "test_c.py")
    result.assert_outcomes(passed=4)
    events = re.findall(r"USER \d|STOPPED|ALONE", result.stdout.str())
    assert events == ["USER 0", "USER 1", "USER 2", "STOPPED", "ALONE"], result.stdout.str()
