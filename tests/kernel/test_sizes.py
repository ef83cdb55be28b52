"""hsx.sizes: the one byte-size parser of the client's --max-buffer-bytes and the server's byte settings."""

from __future__ import annotations

import pytest

from hsx.sizes import format_bytes, parse_bytes


@pytest.mark.parametrize("text, n", [("4GiB", 4 << 30), ("512MiB", 512 << 20), (" 1 MiB ", 1 << 20), ("800MB", 800 * 10**6),
                                     ("1e9", 10**9), ("65536", 65536), ("2g", 2 << 30), ("1.5KiB", 1536)])
def test_sizes_people_write(text, n):
    assert parse_bytes(text) == n


@pytest.mark.parametrize("text", ["lots", "", "0", "-1MiB", "4 parsecs", "MiB"])
def test_what_is_no_positive_size_is_refused(text):
    with pytest.raises(ValueError, match="not a positive size"):
        parse_bytes(text)


def test_the_client_flag_refuses_in_argparse_terms():
    import argparse

    from hsx_client.corpus.cli import _byte_size

    assert _byte_size("16MiB") == 16 << 20
    with pytest.raises(argparse.ArgumentTypeError, match="not a positive size"):
        _byte_size("lots")


def test_format_bytes_names_the_largest_unit_that_divides():
    assert [format_bytes(n) for n in (65536, 1 << 30, 3 << 20, 1000)] == ["64 KiB", "1 GiB", "3 MiB", "1000 bytes"]
    assert all(parse_bytes(format_bytes(n).replace(" bytes", "").replace(" ", "")) == n for n in (65536, 1000, 5 << 40))


def test_fmt_bytes_rounds_to_a_decimal_unit():
    from hsx.sizes import fmt_bytes

    assert [fmt_bytes(n) for n in (None, 512, 1500, 2.3e9, 5e15)] == ["-", "512 B", "1.5 KB", "2.3 GB", "5000.0 TB"]


def test_exit_codes_keep_the_values_users_see():
    from hsx.exit_codes import ExitCode

    assert [int(c) for c in ExitCode] == [0, 1, 2, 130] and f"{ExitCode.REFUSED}" == "2"
