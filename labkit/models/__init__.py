"""How each model family is cut into pipeline stages.

- the tutorial Transformer (`--model tutorial`, the default) lives in `labkit.model` and
  `labkit.stages`;
- `hf`: transformers' own models (Llama-layout causal LMs, GPT-2, BERT): small configs, manual and
  tracer splits, tied weights across stages, masks and position ids as kwargs;
- `adapter`: one interface the reference job uses for either;
- `balance`: split points from measured per-block cost.
"""
