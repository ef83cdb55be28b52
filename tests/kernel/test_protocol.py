"""hsx.protocol: the bodies and reports one side writes and the other reads, each with one owner."""

from __future__ import annotations

import numpy as np
import safetensors.numpy

from hsx.protocol import final_norm
from hsx.protocol.lease import SendReport


def test_final_norm_body_round_trips_and_is_plain_safetensors():
    w = np.linspace(-1, 1, 48, dtype=np.float32)
    body = final_norm.encode(w.astype(np.float16), 1e-5, "gemma", "model.norm.weight")
    got = final_norm.decode(body)
    assert got.weight.dtype == np.float32 and np.allclose(got.weight, w, atol=1e-3)
    assert (got.eps, got.style, got.tensor_name) == (1e-5, "gemma", "model.norm.weight")
    assert safetensors.numpy.load(body)["weight"].shape == (48,)  # any safetensors reader takes it


def test_send_report_round_trips_and_refuses_garbage():
    r = SendReport(10, 4, True, 0.5, 0.25, "zstd")
    assert SendReport.parse(r.header()) == r
    assert SendReport.parse("{not json") is None and SendReport.parse(None) is None
    assert SendReport.parse('{"raw": 1}') is None
