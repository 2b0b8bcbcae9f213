"""transformers' own models, cut into pipeline stages: Llama-layout causal LMs, GPT-2, BERT.

Which family a model is, is found by its module layout, never by its name:

- **causal** (Llama's layout, and every causal LM of transformers that shares it: Qwen2, Mistral,
  ...): `model.embed_tokens`, `model.layers` (a ModuleList of decoder layers), `model.norm`,
  `lm_head`; parameter-free helpers beside them (`model.rotary_emb`) go to every stage.
- **gpt2**: `transformer.wte` + `transformer.wpe`, `transformer.h`, `transformer.ln_f`, `lm_head`
  (tied to `wte`).
- **bert** (masked LM): `bert.embeddings`, `bert.encoder.layer`, `cls` (its decoder tied to the
  word embeddings).

The model is built from a small config with the preset's sizes (random weights, no download):

- `use_cache=False`: a training step needs no key/value cache, and a cache object is state that
  torch.export cannot capture (the tracer fails with it on).
- `attn_implementation="eager"`: plain matmul + softmax attention. The SDPA path picks a kernel
  from the mask at run time (a data-dependent branch export refuses), and eager attention is what
  runs the same in the pipeline and in the reference.
- every dropout 0: the pipelined run and the unsplit reference would draw different random masks,
  and no step could be compared (a model that still holds a dropout > 0 is refused).
- bos/eos/pad ids inside the small vocabulary (transformers warns otherwise).

Manual split (`manual_stage`): every rank builds the whole model on the `meta` device (no
memory), keeps only the modules its stage owns under their original dotted names, materializes
them (`to_empty`) and fills them from the weights (here the seeded unsplit model; on a real node,
a checkpoint), as torchtitan does. The stage's forward calls transformers' own blocks.

Tracer split (`trace_pipe`): `pipeline()` on the whole model with the same settings, plus two:

- traced under `torch.no_grad()`. A module whose forward switches grad mode (transformers' rotary
  module up to 5.23 is decorated `@torch.no_grad()`) is recorded by export as a region of its own (a
  `wrap_with_set_grad_enabled` higher-order op), which the unflattener cuts in two, leaving one part
  without inputs, and the split fails (pytorch/pytorch#184361; the failures on each release:
  bench/RESULTS.md, "labkit/models/hf.py"). Under `no_grad` the switch changes nothing, export
  records no region, and the rotary module stays whole. Training is unaffected: export records the
  operations, not the grad mode; the stages run them with autograd on, and the region held no
  parameter (the reference check compares every gradient). A model whose `no_grad` region does hold
  a parameter's use would differ, and its check would say so. The kit keeps this setting on every release: it changes
  nothing where there is no region (5.24), and keeps 5.23, the oldest release supported, working.
- `labkit.models.skips.carry_skips`: the masks and rotary embeddings are computed once, on the first
  stage, and read by every block; the carry turns those skip connections into a chain (each stage
  passes them on), which torch's backward and its multi-stage schedules need. Only the first stage
  takes the kwargs; any number of stages, every schedule.

Tied weights (GPT-2's `lm_head.weight` is `transformer.wte.weight`; BERT's decoder): cut into
stages on two ranks, the one parameter becomes two copies, each getting only its own stage's part
of the gradient. `TiedWeights.sync` all-reduces (sums) those gradients in a process group of the
ranks that hold a copy, so both copies get the whole gradient and stay equal after the optimizer
step. The alternative is to untie (`untie=True`: `tie_word_embeddings=False`): two independent
matrices, no communication, but a different model (more parameters, not the checkpoint's).
The tracer unties silently (each stage gets its own copy); the same sync repairs it.
Taught in notebook 11.
"""

from __future__ import annotations
import importlib.util
import torch
import torch.nn as nn
from .skips import carry_skips
from .tied import tied_groups


INSTALL_HINT = ("pip install 'labkit[models]'  (or: pip install 'transformers>=5.23'); from a clone: "
                ".venv/bin/pip install -e '.[models]'")


FAMILIES = ("causal", "gpt2", "bert")


IGNORE_INDEX = -100


def require_transformers():
    if importlib.util.find_spec("transformers") is None:
        raise ImportError(f"The transformers models need the `transformers` package, which is not installed. "
                          f"Install it with: {INSTALL_HINT}")
    import transformers
    return transformers


def small_config(model_type: str, preset, untie: bool = False):
    """A transformers config of `model_type` with the preset's sizes (see the module docstring)."""
    tf = require_transformers()
    kw = dict(hidden_size=preset.dim, num_hidden_layers=preset.n_layers, num_attention_heads=preset.n_heads,
              num_key_value_heads=preset.n_heads, intermediate_size=4 * preset.dim, vocab_size=preset.vocab_size,
              max_position_embeddings=max(64, preset.seq_len), pad_token_id=0, bos_token_id=1, eos_token_id=2,
              use_cache=False,
              # every dropout the families know by name: 0 (checked below for any that is left)
              attention_dropout=0.0, hidden_dropout=0.0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
              summary_first_dropout=0.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    if untie:
        kw["tie_word_embeddings"] = False
    try:
        config = tf.AutoConfig.for_model(model_type, **kw)
    except ValueError as e:
        raise ValueError(f"transformers {tf.__version__} knows no model type {model_type!r} ({e}). Use a model "
                         f"type of transformers, e.g. llama, qwen2, mistral, gpt2 or bert.") from None
    config._attn_implementation = "eager"
    return config


def build_hf(model_type: str, preset, seed: int = 0, device="cpu", untie: bool = False) -> nn.Module:
    """The whole model, random weights from `seed` (identical on every rank), or on `meta` (no memory)."""
    tf = require_transformers()
    config = small_config(model_type, preset, untie)
    torch.manual_seed(seed)
    auto = tf.AutoModelForMaskedLM if model_type == "bert" else tf.AutoModelForCausalLM
    with torch.device(device):
        try:
            model = auto.from_config(config, attn_implementation="eager")
        except ValueError as e:
            raise ValueError(f"transformers has no {'masked' if model_type == 'bert' else 'causal'} LM for "
                             f"{model_type!r}: {e}") from None
    family(model)  # refuse a layout the kit cannot cut, before anything else
    live = [n for n, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
    if live:
        raise ValueError(f"{model_type}: dropout still on in {live[:3]}: the pipelined step and the reference would "
                         f"draw different random masks. Set that dropout to 0 in labkit.models.hf.small_config.")
    return model.train()


def _has(model: nn.Module, *paths: str) -> bool:
    for p in paths:
        try:
            model.get_submodule(p)
        except AttributeError:
            return False
    return True


def family(model: nn.Module) -> str:
    """Which layout the model has (the module docstring), found from its modules, not its name."""
    if _has(model, "model.embed_tokens", "model.layers", "model.norm", "lm_head") and \
            isinstance(model.get_submodule("model.layers"), nn.ModuleList):
        return "causal"
    if _has(model, "transformer.wte", "transformer.wpe", "transformer.h", "transformer.ln_f", "lm_head"):
        return "gpt2"
    if _has(model, "bert.embeddings", "bert.encoder.layer", "cls"):
        return "bert"
    top = [n for n, _ in model.named_children()]
    raise ValueError(
        f"{type(model).__name__} has none of the layouts the kit can cut (its top modules: {top}). The kit cuts "
        f"causal LMs laid out as model.embed_tokens / model.layers / model.norm / lm_head (Llama, Qwen2, "
        f"Mistral...), GPT-2 and BERT. For another layout write its stage module as labkit/models/hf.py does.")


BLOCKS = {"causal": "model.layers", "gpt2": "transformer.h", "bert": "bert.encoder.layer"}


def stage_paths(model: nn.Module, stage: int, bounds: list[int]) -> list[str]:
    """The modules (dotted paths, in model order) that `stage` owns: its blocks, plus the input end on
    the first stage, the output end on the last, and parameter-free helpers on every stage."""
    fam = family(model)
    n_stages = len(bounds) - 1
    first, last = stage == 0, stage == n_stages - 1
    blocks = [f"{BLOCKS[fam]}.{i}" for i in range(bounds[stage], bounds[stage + 1])]
    if fam == "causal":
        helpers = [f"model.{n}" for n, m in model.model.named_children()
                   if n not in ("embed_tokens", "layers", "norm")]
        heavy = [h for h in helpers if any(True for _ in model.get_submodule(h).parameters())]
        if heavy:
            raise ValueError(f"{type(model).__name__}: {heavy} hold parameters beside embed_tokens/layers/norm; the "
                             f"kit does not know which stage they belong to.")
        return ((["model.embed_tokens"] if first else []) + helpers + blocks
                + (["model.norm", "lm_head"] if last else []))
    if fam == "gpt2":
        return ((["transformer.wte", "transformer.wpe", "transformer.drop"] if first else []) + blocks
                + (["transformer.ln_f", "lm_head"] if last else []))
    return (["bert.embeddings"] if first else []) + blocks + (["cls"] if last else [])


def _owned(name: str, paths: list[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in paths)


def _set(root: nn.Module, dotted: str, value) -> None:
    parent, _, leaf = dotted.rpartition(".")
    mod = root.get_submodule(parent) if parent else root
    if isinstance(value, nn.Parameter):
        mod.register_parameter(leaf, value)
    else:
        mod.add_module(leaf, value)


class HFStage(nn.Module):
    """One stage of a transformers model: the modules it owns under their original names (so its
    `named_parameters()` are the unsplit model's), and a forward that calls transformers' own
    blocks. Inputs: token ids on the first stage, hidden states `(batch, seq, dim)` after it;
    `attention_mask` (batch, seq; 1 = a real token) and `position_ids` (batch, seq) on EVERY stage:
    each stage builds its own 4-D mask and rotary embeddings from them (cheap, nothing to send)."""

    def __init__(self, model: nn.Module, paths: list[str], stage: int, n_stages: int, bounds: list[int]):
        super().__init__()
        self.family = family(model)
        self.config = model.config
        self.is_first, self.is_last = stage == 0, stage == n_stages - 1
        for path in paths:
            parts = path.split(".")
            parent = self
            for p in parts[:-1]:
                if p not in dict(parent.named_children()):
                    parent.add_module(p, nn.Module())
                parent = parent.get_submodule(p)
            parent.add_module(parts[-1], model.get_submodule(path))
        self.block_ids = list(range(bounds[stage], bounds[stage + 1]))

    def blocks(self):
        holder = self.get_submodule(BLOCKS[self.family])
        return [(i, holder.get_submodule(str(i))) for i in self.block_ids]

    def forward(self, x, attention_mask=None, position_ids=None):
        from transformers import masking_utils as mu

        cfg = self.config
        if self.family == "causal":
            h = self.model.embed_tokens(x) if self.is_first else x
            if position_ids is None:
                position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            # no key/value cache, by position: transformers 5.24 renamed it (past_key_values -> cache)
            args = (cfg, h, attention_mask, None)
            masks = {"full_attention": mu.create_causal_mask(*args, position_ids=position_ids)}
            types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
            if "sliding_attention" in types:
                masks["sliding_attention"] = mu.create_sliding_window_causal_mask(*args, position_ids=position_ids)
            pe = self.model.rotary_emb(h, position_ids)
            for i, layer in self.blocks():
                h = layer(h, attention_mask=masks[types[i]], position_embeddings=pe, position_ids=position_ids)
            return self.lm_head(self.model.norm(h)) if self.is_last else h
        if self.family == "gpt2":
            t = self.transformer
            if position_ids is None:
                position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            h = t.drop(t.wte(x) + t.wpe(position_ids)) if self.is_first else x
            mask = mu.create_causal_mask(cfg, h, attention_mask, None, position_ids=position_ids)  # None: no cache
            for _, block in self.blocks():
                h = block(h, None, mask, position_ids=position_ids)
            return self.lm_head(t.ln_f(h)) if self.is_last else h
        h = self.bert.embeddings(input_ids=x, position_ids=position_ids) if self.is_first else x
        mask = mu.create_bidirectional_mask(config=cfg, inputs_embeds=h, attention_mask=attention_mask)
        for _, layer in self.blocks():
            h = layer(h, mask)
        return self.cls(h) if self.is_last else h


def manual_stage(model_type: str, preset, full: nn.Module, stage: int, bounds: list[int], device,
                 untie: bool = False) -> HFStage:
    """`stage` cut from the model built on `meta`, materialized on `device` and filled from `full`'s
    weights (parameters and buffers, by name)."""
    meta = build_hf(model_type, preset, device="meta", untie=untie)
    n_stages = len(bounds) - 1
    mod = HFStage(meta, stage_paths(meta, stage, bounds), stage, n_stages, bounds)
    groups = [[n for n in g if _owned(n, stage_paths(meta, stage, bounds))] for g in tied_groups(meta)]
    mod.to_empty(device=device)
    for g in groups:  # to_empty makes a new Parameter per name: tie again what the stage holds twice
        for n in g[1:]:
            _set(mod, n, mod.get_parameter(g[0]))
    src = dict(full.named_parameters(remove_duplicate=False))
    src.update(dict(full.named_buffers(remove_duplicate=False)))
    with torch.no_grad():
        for n, t in [*mod.named_parameters(), *mod.named_buffers()]:
            t.copy_(src[n])
    return mod


def meta_stage(model_type: str, preset, stage: int, bounds: list[int], device, seed: int = 0) -> HFStage:
    """`stage` of a model that is never built whole: cut from the model on `meta`, materialized on
    `device`, each parameter filled from a seed of its own name (`seeded_init`: norms' weights 1,
    biases 0, other weights N(0, 0.02)), the buffers of parameter-free helpers (rotary frequencies)
    computed anew. Built twice with the same seed, a stage and the slice `check_stages` holds it against
    are equal, and any two ranks agree on every name they share (notebook 09b)."""
    meta = build_hf(model_type, preset, device="meta")
    mod = HFStage(meta, stage_paths(meta, stage, bounds), stage, len(bounds) - 1, bounds)
    mod.to_empty(device=device)
    seeded_init(mod, seed)
    for name, m in list(mod.named_modules()):
        if name and next(m.parameters(), None) is None and next(m.buffers(), None) is not None:
            with torch.device(device):
                _set(mod, name, type(m)(config=mod.config))
    return mod


def seeded_init(module: nn.Module, seed: int) -> None:
    """Each parameter from a generator seeded by `seed` and its name (zlib.crc32): the same values on
    every rank that holds that name, whatever else it holds."""
    import zlib

    with torch.no_grad():
        for n, p in module.named_parameters():
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(n.encode()))
            if "norm" in n.rsplit(".", 2)[-2] and n.endswith("weight"):
                p.fill_(1.0)
            elif n.endswith("bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def trace_pipe(full: nn.Module, bounds: list[int], example_ids, example_kwargs: dict):
    """`pipeline()` on a copy of the whole model, split at the first block of every stage but the first,
    with the two settings of the module docstring ("Tracer split"): traced under `torch.no_grad()`, and
    the skip connections carried stage to stage (labkit.models.skips). The model's config (use_cache=False,
    eager attention) is what lets torch.export capture it at all."""
    import copy

    from torch.distributed.pipelining import SplitPoint, pipeline

    fam = family(full)
    split_spec = {f"{BLOCKS[fam]}.{b}": SplitPoint.BEGINNING for b in bounds[1:-1]}
    with torch.no_grad():
        pipe = pipeline(copy.deepcopy(full), mb_args=(example_ids,), mb_kwargs=example_kwargs, split_spec=split_spec)
    carry_skips(pipe)
    return pipe


def first_stage_inputs(pipe) -> list[str]:
    """The names of the whole model's inputs in the order the split graph passes them to the first
    stage, positionally. Pass them to `step` in this order, positionally: a traced first stage's
    `forward(input_ids, attention_mask, position_ids)` may put its inputs in another order than the
    one its graph reads them in (seen on GPT-2 with torch 2.13: keywords by name swap the mask and
    the position ids), while the split graph's own call is always right."""
    call = next(n for n in pipe.split_gm.graph.nodes if n.op == "call_module")
    return [a.target if a.op == "placeholder" else a.name for a in call.args]


def drop_unused_parameters(gm: nn.Module) -> list[str]:
    """A traced stage can carry a tied parameter's other name without using it (GPT-2's first stage
    gets an `lm_head.weight` beside `transformer.wte.weight`); such a parameter never gets a gradient
    and is not part of the stage. Removes them; returns their names."""
    import torch.fx as fx

    if not isinstance(gm, fx.GraphModule):
        return []
    used = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            used.add(str(node.target))
        elif node.op == "call_module":
            used.update(f"{node.target}.{n}" for n, _ in gm.get_submodule(node.target).named_parameters())
    dropped = [n for n, _ in gm.named_parameters(remove_duplicate=False) if n not in used]
    for n in dropped:
        parent, _, leaf = n.rpartition(".")
        delattr(gm.get_submodule(parent) if parent else gm, leaf)   # nn.Module drops the parameter
    return dropped


def make_batch(model_type: str, preset, batch_size: int, seed: int, device="cpu"):
    """Token ids, targets and the kwargs every stage needs, `(batch, seq)` each.

    Causal LMs: targets are the next tokens (the last position ignored), attention_mask all ones,
    position_ids 0..seq-1. BERT: sequences of different lengths padded at the end (attention_mask 0
    there: the per-microbatch padding mask), a quarter of the real tokens replaced by the mask id and
    predicted (targets IGNORE_INDEX elsewhere, and at least one predicted token per sequence)."""
    seq, vocab = preset.seq_len, preset.vocab_size
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randint(4, vocab, (batch_size, seq), generator=g)
    mask = torch.ones(batch_size, seq, dtype=torch.long)
    pos = torch.arange(seq).repeat(batch_size, 1)
    if model_type != "bert":
        y = torch.full_like(x, IGNORE_INDEX)
        y[:, :-1] = x[:, 1:]
    else:
        lengths = [seq - (i % 3) * (seq // 4) for i in range(batch_size)]
        y = torch.full_like(x, IGNORE_INDEX)
        for i, n in enumerate(lengths):
            mask[i, n:] = 0
            x[i, n:] = 0  # pad id
            pick = torch.rand(n, generator=g) < 0.25
            pick[i % n] = True
            y[i, :n][pick] = x[i, :n][pick]
            x[i, :n][pick] = 3  # the mask token's id
    kwargs = {"attention_mask": mask.to(device), "position_ids": pos.to(device)}
    return x.to(device), y.to(device), kwargs


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy over the microbatch's predicted tokens (IGNORE_INDEX skipped), on the last stage."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                                       ignore_index=IGNORE_INDEX)
