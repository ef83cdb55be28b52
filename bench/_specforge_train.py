"""SpecForge 0.2's own code training a draft from an hsx offline corpus on the CPU
(bench/draft_families.py): its algorithm registry resolves the draft; the offline provider's
reader, LocalFeatureStore, normalizer and collator read the corpus (as specforge.launch's
offline runtime wires them); specforge.training.assembly.build_model_bundle builds the
registered draft and training model from the target checkpoint; the registered step
(train strategy) gives the loss. The loop around them (AdamW, a fixed number of steps) is
ours, to keep the run in one plain CPU process.

The DFlash family's draft config is SpecForge's own default for the target
(TargetDerivedDraftDefaults: 1 layer, populate_dflash_generated_config), with its
`dflash_config.target_layer_ids` set to the corpus's layers (hsx_format.json's
trainer_layers, SpecForge numbering), as a user passes them in a draft config."""

from __future__ import annotations

import json
from pathlib import Path


# EAGLE-3 runs in SpecForge's default bfloat16: its frozen target head is bfloat16 whatever the
# config says (specforge/modeling/target/target_head.py, TargetHead.from_pretrained), and the
# stored hidden_state meets it as stored, so the corpus and the draft are bfloat16 too.
DTYPE = {"eagle3": "bfloat16"}
# EAGLE-3's loss is a Triton kernel (specforge/core/loss.py, LogSoftmaxLoss): on the CPU the
# bench runs this file in a process with TRITON_INTERPRET=1, where each token of a batch is one
# interpreted program; its samples are cut shorter to keep the run in minutes.
MAX_LENGTH = {"eagle3": 64}


def _config(model: Path, data: Path, draft: str, steps: int, draft_config: Path | None):
    from specforge.config.schema import Config

    mapping = data / "vocab_mapping" / "vocab_mapping.pt"  # the corpus's draft vocab (EAGLE-3's d2t/t2d)
    return Config.model_validate({
        "model": {"target_model_path": str(model), "torch_dtype": DTYPE.get(draft, "float32"),
                  "lm_head_key": "model.embed_tokens.weight",
                  **({"draft_model_config": str(draft_config)} if draft_config else {}),
                  **({"vocab_mapping_path": str(mapping)} if draft == "eagle3" else {})},
        "data": {"hidden_states_path": str(data), "max_length": MAX_LENGTH.get(draft, 128)},
        "training": {"strategy": draft, "max_steps": steps, "learning_rate": 3e-3, "attention_backend": "sdpa",
                     "ttt_length": 7},
    })


def _draft_config(model: Path, data: Path, draft: str, work: Path, registration) -> Path:
    """SpecForge's generated draft config for the target (TargetDerivedDraftDefaults). EAGLE-3:
    its own, with the corpus's draft vocab size (its default, 32000, exceeds the tiny target's
    vocab). The DFlash family: DFlash's (the one of them that generates one: DSpark and Domino
    take a config file), named for this draft's architecture, with the corpus's target layers."""
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.training.model_loading import resolve_draft_config

    base = registration if draft == "eagle3" else builtin_algorithm_registry().resolve("dflash")
    dc = resolve_draft_config(_config(model, data, base.name, 1, None), provider=base.providers.model.draft_config)
    if draft == "eagle3":
        import torch

        dc.draft_vocab_size = int(torch.load(data / "vocab_mapping" / "vocab_mapping.pt")["d2t"].numel())
    else:
        ids = json.loads((data / "hsx_format.json").read_text())["trainer_layers"]["target_layer_ids"]
        provider = registration.providers.model.draft_config
        dc.architectures = [provider.architecture]
        if provider.expected_auto_map_model:
            dc.auto_map = {"AutoModel": provider.expected_auto_map_model}
        dc.dflash_config = {**dict(getattr(dc, "dflash_config", None) or {}), "target_layer_ids": ids}
        if draft == "domino":  # Domino's GRU head sizes (specforge/modeling/draft/domino.py reads them)
            dc.dflash_config.update(emb_dim=dc.hidden_size, gru_hidden_dim=dc.hidden_size)
        dc.block_size = 4
    out = work / f"draft-config-{draft}.json"
    out.write_text(dc.to_json_string())
    return out


def _batches(registration, data: Path, max_len: int):
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    provider = registration.providers.offline_for("text")
    refs = provider.build_reader(str(data), run_id="hsx", ttt_length=7, max_len=max_len).read()
    loader = FeatureDataLoader(
        LocalFeatureStore("hsx"), refs=refs, batch_size=1, collate_fn=provider.build_collator(),
        per_sample_transform=provider.build_normalizer(max_len, ttt_length=7, use_usp_preprocess=False),
        drop_last=False, strategy=registration.name,
    )
    return list(loader)


def train_specforge(data: Path, draft: str, model: Path, steps: int) -> tuple[list[float], int]:
    """The loss of each step, and the number of batches the steps cycle through (step i
    trains batch i % n, one sample each)."""
    import torch

    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.training.assembly import build_model_bundle

    torch.manual_seed(0)
    registration = builtin_algorithm_registry().resolve(draft)
    work = Path(data).parent
    cfg = _config(model, data, draft, steps, _draft_config(model, data, draft, work, registration))
    bundle = build_model_bundle(cfg, algorithm=registration)
    step = registration.providers.step.build(bundle.model, target_head=bundle.target_head)
    params = [p for p in step.trainable_module().parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.training.learning_rate)
    batches = _batches(registration, data, cfg.data.max_length)
    losses = []
    for i in range(steps):
        out = step.forward_loss(batches[i % len(batches)])
        opt.zero_grad()
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(round(float(out.loss.detach()), 4))
    return losses, len(batches)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    p = argparse.ArgumentParser(description="Train a SpecForge draft from an hsx offline corpus on the CPU; "
                                            "prints the loss of each step (bench/draft_families.py runs it)")
    p.add_argument("--data", required=True, type=Path, help="an hsx corpus (--format specforge --draft D)")
    p.add_argument("--draft", required=True, choices=["eagle3", "dflash", "dspark", "domino"])
    p.add_argument("--model", required=True, type=Path, help="the target model directory")
    p.add_argument("--steps", type=int, default=40)
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    losses, batches = train_specforge(a.data, a.draft, a.model, a.steps)
    print(f"BATCHES {batches}")
    print("LOSSES " + json.dumps(losses))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
