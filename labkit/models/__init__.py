"""How each model family is cut into pipeline stages.

- the tutorial Transformer (`--model tutorial`, the default) lives in `labkit.models.tutorial` and
  `labkit.worker.stages`;
- `hf`: transformers' own models (Llama-layout causal LMs, GPT-2, BERT): small configs, manual and
  tracer splits, tied weights across stages, masks and position ids as kwargs;
- `adapter`: one interface the reference job uses for either;
- `balance`: split points from measured per-block cost;
- `tied`: tied weights across stages (GPT-2's embedding and head);
- `skips`: skip connections of a traced model carried stage to stage;
- `small`: a small pre-norm transformer LM the verdict's lesson cuts, breaks and checks (each part
  from its own seed: a rank can build only its own blocks);
- `workload`: the controlled workload, stages whose compute time you set (launched by
  `labkit.launching.controlled`).

May import: labkit.core, labkit.versions, labkit.schedules, labkit.config, labkit.worker (stages, memory).
Never the launching side: a model does not launch (the controlled workload's runner is
labkit.launching.controlled).
"""

from ..core import exports as _exports

__getattr__, __dir__, __all__ = _exports(__name__, {
    ".tutorial": ("Transformer", "build_model", "make_batch", "tokenwise_loss_fn"),
    ".workload": ("TimedBlock", "WorkloadConfig", "mse"),
    ".balance": ("balance", "balance_config", "stage_sums"),
    ".skips": ("carry_skips",),
    ".small": ("SmallLM", "cut_small_lm", "lm_loss", "small_lm"),
    ".": ("hf",),
})
