"""Model presets (`PRESETS`: sizes of the tutorial Transformer and of the transformers models) and
which models a run may name (`validate_model`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import ConfigError

LAYOUTS = ("batch", "tutorial")


@dataclass(frozen=True)
class ModelPreset:
    """Sizes of the tutorial's Transformer and of the batch it is trained on."""

    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    batch_size: int
    seq_len: int
    note: str = ""


PRESETS: dict[str, ModelPreset] = {
    # A step well under a second with 2 ranks on 2 CPU cores.
    "small": ModelPreset(dim=64, n_layers=8, n_heads=4, vocab_size=256, batch_size=8, seq_len=32,
                         note="CPU laptops and CI"),
    # Even smaller, for test suites that launch many jobs (batch 8, seq 16: never the same size, so a
    # shape always says which dimension is which).
    "tiny": ModelPreset(dim=32, n_layers=8, n_heads=2, vocab_size=64, batch_size=8, seq_len=16,
                        note="test suites"),
    # The small sizes with a 32k vocabulary: the output layer and loss weigh several blocks, so the
    # last stage of an even split is the slowest (balancing, --split-points auto, labkit.models.balance).
    "wide_vocab": ModelPreset(dim=64, n_layers=8, n_heads=4, vocab_size=32768, batch_size=8, seq_len=32,
                              note="a heavy last stage: balancing"),
    # The official tutorial's sizes: ~55 s per step on 2 CPU cores, meant for GPUs.
    "tutorial": ModelPreset(dim=512, n_layers=8, n_heads=8, vocab_size=10000, batch_size=32, seq_len=500,
                            note="GPUs (the official tutorial's sizes)"),
}


MODELS_EXTRA = "models"


MODELS_INSTALL = ("pip install 'labkit[models]' (transformers>=5.23); in a clone of the lab: "
                  ".venv/bin/pip install -e '.[models]'")


BLOCK_PREFIXES = {"gpt2": "transformer.h", "bert": "bert.encoder.layer"}
"""Where a family's blocks live, for split points given by module name (Llama's layout: model.layers)."""


def validate_model(model: str, layout: str = "batch") -> None:
    """`tutorial`, or a transformers model type with transformers installed (checked without importing it)."""
    import importlib.util
    import re

    if not isinstance(model, str) or not re.fullmatch(r"[a-z0-9][a-z0-9_\-]*", model):
        raise ConfigError(f"model must be `tutorial` or a transformers model type in lower case (llama, gpt2, bert, "
                          f"qwen2...), got {model!r}.")
    if model == "tutorial":
        return
    if layout != "batch":
        raise ConfigError(f"--layout {layout} is the tutorial Transformer's; --model {model} always has tokens "
                          f"(batch, seq). Drop --layout.")
    if importlib.util.find_spec("transformers") is None:
        raise ConfigError(f"--model {model} builds transformers' own {model} model, and transformers is not "
                          f"installed. Install the kit's `{MODELS_EXTRA}` extra: {MODELS_INSTALL}")
