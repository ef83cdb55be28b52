"""Run `python -m hsx_client.speculators_train ARGS` on a CPU-only torch (tests only).

speculators 0.9's Trainer needs an accelerator in two places, neither on the data path:
`Trainer.setup_model` moves the draft to accelerator index 0 (`self.model.to(self.local_rank)`,
local_rank 0), and `_StepTimer` calls `torch.accelerator.synchronize()` on every logged
step (step 0 always is). Without an accelerator both raise "Cannot access accelerator
device when none is available." This runner points the first at the CPU and makes the
second a no-op, then runs the wrapper unchanged; the dataloaders, the hsx backend, the
draft model, its loss and the optimizer are speculators' own code.
"""

from __future__ import annotations

import sys

import torch


def patch_for_cpu() -> None:
    """Without an accelerator: the trainer's device is the CPU, accelerator syncs are no-ops."""
    from hsx_client import speculators_backend  # noqa: F401 - registered before speculators' config

    import speculators.train.trainer as trainer

    if not torch.accelerator.is_available():
        trainer.get_local_rank = lambda: "cpu"
        torch.accelerator.synchronize = lambda *a, **k: None


def main() -> int:
    from hsx_client import speculators_train

    patch_for_cpu()
    return speculators_train.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
