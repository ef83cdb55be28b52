# Fault injection for tests/service/http/test_service_hardening.py: on PYTHONPATH of one `hsx serve`
# (and so of its vLLM engine and worker processes), a forward whose input holds token id
# HSX_FAULT_TOKEN raises inside the model, as a real kernel failure would.
import os

_token = int(os.environ.get("HSX_FAULT_TOKEN", "-1"))
if _token >= 0:
    import torch
    import torch.nn.functional as F

    _embedding = F.embedding

    def _faulty_embedding(input, weight, *args, **kwargs):
        # Eager only (the server under test runs --enforce-eager): a data-dependent
        # branch cannot be traced into a compiled graph.
        if not torch.compiler.is_compiling() and isinstance(input, torch.Tensor) and bool((input == _token).any()):
            raise RuntimeError(f"injected fault: token {_token} reached the model")
        return _embedding(input, weight, *args, **kwargs)

    F.embedding = _faulty_embedding
