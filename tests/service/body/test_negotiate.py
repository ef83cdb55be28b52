"""The body room's negotiation (body/negotiate.py): a real parse of Accept / Accept-Encoding
(q-values, not a substring test) and the coding chosen from it. Moved here from
tests/service/http/test_service_owners.py and tests/kernel/test_bf16split.py unchanged."""

from __future__ import annotations

import pytest

from hsx import bf16split
from hsx.wire import LEASE_MEDIA_TYPE
from hsx_service.body.negotiate import accepts_encoding, accepts_media, choose_coding, weights


@pytest.mark.parametrize("accept, want", [
    (LEASE_MEDIA_TYPE, True),
    (f"application/x-safetensors;q=0.5, {LEASE_MEDIA_TYPE}", True),
    (f"{LEASE_MEDIA_TYPE};q=0", False),  # a substring test said yes
    (f"{LEASE_MEDIA_TYPE}; q=0.0, application/x-safetensors", False),
    (f"{LEASE_MEDIA_TYPE}+extra", False),  # another type that starts alike
    (f"{LEASE_MEDIA_TYPE.upper()}", True),  # media types are case-insensitive
    ("*/*", False),  # an opt-in: no wildcard
    (f"{LEASE_MEDIA_TYPE};q=oops", False),
    (None, False),
])
def test_lease_media_type_is_parsed_not_searched(accept, want):
    assert accepts_media(accept, LEASE_MEDIA_TYPE) is want


def test_accept_encoding_weights():
    assert accepts_encoding("gzip, zstd", "zstd") and accepts_encoding("*", "zstd")
    assert not accepts_encoding("zstd;q=0, *", "zstd")  # named beats the wildcard
    assert not accepts_encoding("gzip", "zstd") and not accepts_encoding(None, "zstd")
    assert weights("a;q=2, b;q=-1, c") == {"a": 0.0, "b": 0.0, "c": 1.0}
    assert choose_coding(None, "zstd;q=0", "bfloat16") == "identity"


@pytest.mark.parametrize("accept,encoding,dtype,want", [
    (bf16split.MEDIA_TYPE, "zstd", "bfloat16", "bf16split"),
    (f"{bf16split.MEDIA_TYPE}, application/x-safetensors;q=0.5", "zstd", "bfloat16", "bf16split"),
    (f"{bf16split.MEDIA_TYPE};q=0", "zstd", "bfloat16", "zstd"),
    (bf16split.MEDIA_TYPE, "zstd", "float32", "zstd"),  # not bf16: plain zstd
    (bf16split.MEDIA_TYPE, None, "bfloat16", "identity"),  # its frames are zstd: not accepted
    ("*/*", "zstd", "bfloat16", "zstd"),  # an opt-in: never by wildcard
    (None, "identity", "bfloat16", "identity"),
])
def test_choose_coding(accept, encoding, dtype, want):
    assert choose_coding(accept, encoding, dtype) == want
