"""The fast tier stays free of engines: conftest.py fails a test that starts `hsx serve`,
or uses a fixture that did, without `@pytest.mark.engine` (run in a pytest of its own)."""

from __future__ import annotations

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
