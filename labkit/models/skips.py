"""Skip connections in a traced Pipe, carried stage by stage so every stage talks only to its neighbours.

A transformers model computes a few values once, before its first block, and every block reads
them: the 4-D attention mask (GPT-2, BERT, Llama) and the rotary cos/sin (Llama and its family).
`pipeline()` puts that computation in the first stage, so stage 0 sends them straight to stages
2, 3, ...: a *skip connection*. torch's pipelining refuses both directions of it:

- backward: a stage output with more than one consumer fails at build time ('Backward of skip
  connections not supported yet');
- the multi-stage runtimes (Interleaved1F1B, ZBVZeroBubble, ...) send only to the next stage
  ('PipelineScheduleMulti only supports adjacent-stage communication').

`carry_skips(pipe)` rewrites the Pipe's split graph so that each such value travels along the
pipeline: every stage between its producer and its last consumer takes it as one more input and
returns it (a copy: see below) as one more output. Every stage's outputs then ARE the next stage's
inputs, in the order it reads them, which is what both of torch's stage frontends need
(`pipe.build_stage` reads the graph; a `PipelineStage` built on a stage module calls it with the
previous stage's outputs positionally). The cost: each carried value is sent once per stage
boundary instead of once per consumer, and its gradient comes back the same way (a stage adds its
own blocks' part of the gradient to the part it receives: autograd does that sum through the copy).
The copy is a clone: an alias (a view) fails the zero-bubble schedules' backward, which detaches
every stage output in place ('Can't detach views in-place'), and returning the input itself would
send the stage's receive buffer. A clone is small beside the activations it travels with (the mask
is batch x seq x seq per microbatch, cos/sin batch x seq x head_dim, once per stage; each block
keeps batch x heads x seq x seq of attention alone). The model's arithmetic is untouched, which
the reference check of every run confirms.
"""

from __future__ import annotations

import operator

import torch


def carry_skips(pipe) -> dict[int, list[str]]:
    """Rewrite `pipe` (from `pipeline()`) in place as the module docstring says. Returns, for each stage
    that passes values on to the next one, their names (empty when the Pipe had no skip connection)."""
    import torch.fx as fx

    g = pipe.split_gm.graph
    calls = [node for node in g.nodes if node.op == "call_module"]  # stage i's call, in stage order
    n = len(calls)

    def stage_module(m: int):
        return pipe.split_gm.get_submodule(calls[m].target)

    def placeholders(m: int) -> list:
        return [p for p in stage_module(m).graph.nodes if p.op == "placeholder"]

    stage_of = {c: i for i, c in enumerate(calls)}

    def producer(v: fx.Node) -> int:
        """The stage whose output `v` is (-1: an input of the whole model)."""
        base = v
        while base.op == "call_function" and base.target is operator.getitem:
            base = base.args[0]
        if base.op == "placeholder":
            return -1
        if base not in stage_of:
            raise ValueError(f"carry_skips: stage input {v.name} comes from {base.op} {base.target}, not from a "
                             f"stage or the model's inputs; this Pipe's split graph is not one it can rewrite")
        return stage_of[base]

    for node in g.nodes:  # the model's output must come from the last stage alone
        if node.op == "output":
            for v in node.all_input_nodes:
                if producer(v) not in (n - 1, -1):
                    raise ValueError(f"carry_skips: the model's output {v.name} comes from stage {producer(v)}, "
                                     f"not the last one; a pipeline cannot return it")

    # 1. which values each stage takes, in order: its own inputs, then what it carries
    args = [list(c.args) for c in calls]
    for a in args:
        if any(not isinstance(v, fx.Node) for v in a):
            raise ValueError("carry_skips: a stage takes a constant argument; not a Pipe it can rewrite")
    if all(producer(v) == i - 1 for i in range(1, n) for v in args[i]):
        return {}  # a chain already: left exactly as it was
    for i in range(n - 1, 0, -1):
        for v in list(args[i]):
            for m in range(producer(v) + 1, i):
                if v not in args[m]:
                    args[m].append(v)

    # 2. inside each stage: a placeholder for each new input (the consumer's own placeholder's metadata)
    meta_of: dict[fx.Node, dict] = {}
    for i in range(n):
        for v, p in zip(calls[i].args, placeholders(i)):
            meta_of.setdefault(v, p.meta)
    for m in range(n):
        sub = stage_module(m)
        have = placeholders(m)
        for v in args[m][len(calls[m].args):]:
            with sub.graph.inserting_after(have[-1]):
                p = sub.graph.placeholder(f"carried_{v.name}")
            p.meta.update(meta_of[v])
            have.append(p)

    # 3. each stage but the last returns exactly what the next one takes, in that order
    def output_values(sub):
        out = next(o for o in sub.graph.nodes if o.op == "output")
        res = out.args[0]
        return out, (list(res) if isinstance(res, (tuple, list)) else res)

    new_args = [list(a) for a in args]
    carried: dict[int, list[str]] = {}
    for m in range(n - 1):
        sub = stage_module(m)
        out, res = output_values(sub)
        mine = dict(zip(args[m], placeholders(m)))
        values = []
        for v in args[m + 1]:
            if producer(v) == m:  # its own output: the tuple element (or the whole output) v names
                if v is calls[m]:
                    values.append(res)
                elif v.args[0] is calls[m] and isinstance(res, list):
                    values.append(res[v.args[1]])
                else:
                    raise ValueError(f"carry_skips: stage {m + 1} reads {v.name}, a nested part of stage {m}'s "
                                     f"output; not a Pipe it can rewrite")
            else:  # carried through: its input, returned as a copy (the module docstring says why)
                with sub.graph.inserting_before(out):
                    a = sub.graph.call_function(torch.ops.aten.clone.default, (mine[v],))
                a.meta.update(mine[v].meta)
                values.append(a)
                carried.setdefault(m, []).append(v.name)
        out.args = (tuple(values),)  # outputs no later stage reads are no longer sent (still computed)
        sub.graph.lint()
        sub.recompile()
        # the split graph reads them back one by one, in order (torch numbers a stage's outputs by the
        # order of its getitem users)
        after = calls[m]
        getitems = []
        for k in range(len(values)):
            with g.inserting_after(after):
                after = g.call_function(operator.getitem, (calls[m], k))
            getitems.append(after)
        new_args[m + 1] = getitems
    for m in range(n):
        calls[m].args = tuple(new_args[m])
    for node in reversed(list(g.nodes)):  # the old getitems, now unused
        if node.op == "call_function" and node.target is operator.getitem and not node.users:
            g.erase_node(node)
    g.lint()
    pipe.split_gm.recompile()
    return carried
