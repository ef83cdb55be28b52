"""`python -m hsx_client.speculators_train <speculators train flags>`: speculators' own
trainer, with the `hsx` hidden-states backend registered.

speculators 0.9 finds backends in a registry that imports fill (it has no entry points)
and collects their flags when its config module is first imported, so the backend must
be imported before speculators' config: this module does that, then runs exactly what
`speculators train` runs, `main(TrainConfig.resolve(argv))`. Every speculators flag works
as documented there; under torchrun each rank runs this module:

    torchrun --nproc-per-node 8 -m hsx_client.speculators_train --data-path DATA \\
        --hidden-states-backend hsx --hsx-servers http://gpu-1:8001 ...

With `--hidden-states-backend hsx`, the hsx settings are checked before the draft model is
built (exit 2 with the reason: no servers given, an unreadable key file...).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from hsx_client import speculators_backend  # registers "hsx" before speculators' config is imported

    speculators_backend.check_registered()
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    cfg = TrainConfig.resolve(argv)
    if cfg.data.hidden_states_backend == speculators_backend.BACKEND_NAME:
        try:
            speculators_backend.settings_from_args(argparse.Namespace(**cfg.flatten()), cfg.data.data_path)
        except ValueError as exc:
            print(f"hsx_client.speculators_train: {exc}", file=sys.stderr)
            return 2
    train(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
