"""The core's errors carry no transport; http/errors.py's STATUS table is the one place each
becomes an HTTP status (issue 37)."""

from __future__ import annotations

import inspect

from hsx_service.core import errors
from hsx_service.core.keys import key_matches
from hsx_service.http.errors import STATUS, render, status_of


def _service_errors() -> list[type[errors.ServiceError]]:
    return [c for _, c in inspect.getmembers(errors, inspect.isclass) if issubclass(c, errors.ServiceError)]


def test_every_domain_error_has_its_own_status_and_none_of_its_own_http():
    assert set(_service_errors()) == set(STATUS)
    assert not any(hasattr(c, "status") or hasattr(c, "headers") for c in _service_errors())


def test_render_answers_with_the_tables_status():
    assert status_of(errors.TooLarge("x")) == 413 and status_of(errors.ClientGone("x")) == 499
    answer = render(errors.Unauthorized("no key"), "r1", None)
    assert answer.status_code == 401 and answer.headers["WWW-Authenticate"] == "Bearer"
    assert render(errors.Draining("bye"), None, None).headers["Retry-After"] == "1"


def test_key_matches_any_accepted_key():
    assert key_matches(b"k2", [b"k1", b"k2"]) and not key_matches(b"k3", [b"k1", b"k2"]) and not key_matches(b"", [])
