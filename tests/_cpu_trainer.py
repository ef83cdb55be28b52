"""For tests/gpu/online_train.py's CPU smoke run: the product's CPU route
(`python -m hsx_client.training.speculators_train --device cpu`, hsx_client.training.speculators_train.use_cpu),
applied only where there is no accelerator."""

from __future__ import annotations


def patch_for_cpu() -> None:
    import torch

    from hsx_client.training import speculators_train

    if not torch.accelerator.is_available():
        speculators_train.use_cpu()
