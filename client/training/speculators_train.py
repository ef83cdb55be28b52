"""`python -m hsx_client.training.speculators_train <speculators train flags>`: speculators' own
trainer, with the `hsx` hidden-states backend registered.

speculators 0.9 finds backends in a registry that imports fill (it has no entry points)
and collects their flags when its config module is first imported, so the backend must
be imported before speculators' config: this module does that, then runs exactly what
`speculators train` runs, `main(TrainConfig.resolve(argv))`. Every speculators flag works
as documented there; under torchrun each rank runs this module:

    torchrun --nproc-per-node 8 -m hsx_client.training.speculators_train --data-path DATA \\
        --hidden-states-backend hsx --hsx-servers http://gpu-1:8001 ...

With `--hidden-states-backend hsx`, the hsx settings are checked before the draft model is
built (exit 2 with the reason: no servers given, an unreadable key file...).

`--device cpu` (this module's one flag of its own) trains on the CPU, to try the pipeline
on a box without a GPU (slowly; one process, no torchrun). speculators 0.9's Trainer needs
an accelerator in two places, neither on the data path: `Trainer.setup_model` moves the
draft to accelerator index 0 (`self.model.to(self.local_rank)`), and its step timer calls
`torch.accelerator.synchronize()` on every logged step. `use_cpu` points the first at the
CPU and makes the second a no-op, and `--loss-implementation eager --draft-attn-impl sdpa`
are the defaults there (speculators' own are a Triton loss and flex attention); the dataloaders, the hsx backend, the draft model, its
loss and the optimizer stay speculators' own code. Without the flag and without an
accelerator, the run is refused at once (exit 2), before the data side is built.
"""

from __future__ import annotations

import argparse
import sys

from hsx.exit_codes import ExitCode

DEVICES = ("auto", "cpu")


# What speculators' defaults need that a CPU lacks (a Triton loss, flex attention): set
# with --device cpu unless given.
CPU_DEFAULTS = {"--loss-implementation": "eager", "--draft-attn-impl": "sdpa"}


# Drafts whose attention speculators fixes (models/mtp: "--draft-attn-impl is not configurable for MTP").
FIXED_ATTENTION = ("mtp",)


def _speculator_type(argv: list[str]) -> str | None:
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--speculator-type")
    return p.parse_known_args(argv)[0].speculator_type


def _split_device(argv: list[str]) -> tuple[str, list[str]]:
    """(--device, the other flags, for speculators)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    p.add_argument("--device", choices=DEVICES, default="auto")
    ours, rest = p.parse_known_args(argv)
    if ours.device == "cpu":
        given = {a.split("=", 1)[0] for a in rest}
        defaults = dict(CPU_DEFAULTS)
        if _speculator_type(rest) in FIXED_ATTENTION:  # speculators refuses the flag for these
            defaults.pop("--draft-attn-impl")
        rest += [x for flag, value in defaults.items() if flag not in given for x in (flag, value)]
    return ours.device, rest


def use_cpu() -> None:
    """Make speculators' Trainer run on the CPU (see the module doc)."""
    import torch

    import speculators.train.trainer as trainer

    trainer.get_local_rank = lambda: "cpu"
    torch.accelerator.synchronize = lambda *a, **k: None


def main(argv: list[str] | None = None) -> int:
    device, argv = _split_device(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print("hsx_client.training.speculators_train: speculators' `train` flags, plus --device {auto,cpu} "
              "(cpu: train on the CPU, to try it without a GPU)")
    from hsx_client.training import speculators_backend  # registers "hsx" before speculators' config is imported

    speculators_backend.check_registered()
    from speculators.train.cli import main as train
    from speculators.train.config import TrainConfig

    cfg = TrainConfig.resolve(argv)
    if cfg.data.hidden_states_backend == speculators_backend.BACKEND_NAME:
        try:
            speculators_backend.settings_from_args(argparse.Namespace(**cfg.flatten()), cfg.data.data_path)
        except ValueError as exc:
            print(f"hsx_client.training.speculators_train: {exc}", file=sys.stderr)
            return ExitCode.REFUSED
    if device == "cpu":
        use_cpu()
    else:
        import torch

        if not torch.accelerator.is_available():
            print("hsx_client.training.speculators_train: no GPU (accelerator) found; speculators' trainer needs one. "
                  "Add --device cpu to try it on the CPU (slow)", file=sys.stderr)
            return ExitCode.REFUSED
    train(cfg)
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
