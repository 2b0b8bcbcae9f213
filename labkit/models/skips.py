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
    sg = _SplitGraph(pipe)
    sg.check_outputs()
    args = _stage_inputs(sg)
    if args is None:
        return {}  # a chain already: left exactly as it was
    _add_placeholders(sg, args)
    new_args = [list(a) for a in args]
    carried: dict[int, list[str]] = {}
    for m in range(sg.n - 1):
        values = _return_next_inputs(sg, m, args, carried)
        new_args[m + 1] = _read_back(sg, m, len(values))
    for m in range(sg.n):
        sg.calls[m].args = tuple(new_args[m])
    g = sg.graph
    for node in reversed(list(g.nodes)):  # the old getitems, now unused
        if node.op == "call_function" and node.target is operator.getitem and not node.users:
            g.erase_node(node)
    g.lint()
    pipe.split_gm.recompile()
    return carried


class _SplitGraph:
    """A Pipe's split graph: one call_module node per stage, in stage order, and who produced what."""

    def __init__(self, pipe):
        self.pipe = pipe
        self.graph = pipe.split_gm.graph
        self.calls = [node for node in self.graph.nodes if node.op == "call_module"]  # stage i's call
        self.n = len(self.calls)
        self.stage_of = {c: i for i, c in enumerate(self.calls)}

    def stage_module(self, m: int):
        return self.pipe.split_gm.get_submodule(self.calls[m].target)

    def placeholders(self, m: int) -> list:
        return [p for p in self.stage_module(m).graph.nodes if p.op == "placeholder"]

    def producer(self, v) -> int:
        """The stage whose output `v` is (-1: an input of the whole model)."""
        base = v
        while base.op == "call_function" and base.target is operator.getitem:
            base = base.args[0]
        if base.op == "placeholder":
            return -1
        if base not in self.stage_of:
            raise ValueError(f"carry_skips: stage input {v.name} comes from {base.op} {base.target}, not from a "
                             f"stage or the model's inputs; this Pipe's split graph is not one it can rewrite")
        return self.stage_of[base]

    def check_outputs(self) -> None:
        """The model's output must come from the last stage alone."""
        for node in self.graph.nodes:
            if node.op == "output":
                for v in node.all_input_nodes:
                    if self.producer(v) not in (self.n - 1, -1):
                        raise ValueError(f"carry_skips: the model's output {v.name} comes from stage "
                                         f"{self.producer(v)}, not the last one; a pipeline cannot return it")


def _stage_inputs(sg: _SplitGraph) -> list[list] | None:
    """Step 1: which values each stage takes, in order: its own inputs, then what it carries; None when
    every stage reads only the previous one's outputs (nothing to carry)."""
    import torch.fx as fx

    args = [list(c.args) for c in sg.calls]
    for a in args:
        if any(not isinstance(v, fx.Node) for v in a):
            raise ValueError("carry_skips: a stage takes a constant argument; not a Pipe it can rewrite")
    if all(sg.producer(v) == i - 1 for i in range(1, sg.n) for v in args[i]):
        return None
    for i in range(sg.n - 1, 0, -1):
        for v in list(args[i]):
            for m in range(sg.producer(v) + 1, i):
                if v not in args[m]:
                    args[m].append(v)
    return args


def _add_placeholders(sg: _SplitGraph, args: list[list]) -> None:
    """Step 2: inside each stage, a placeholder for each new input (the consumer's own placeholder's
    metadata)."""
    meta_of: dict = {}
    for i in range(sg.n):
        for v, p in zip(sg.calls[i].args, sg.placeholders(i)):
            meta_of.setdefault(v, p.meta)
    for m in range(sg.n):
        sub = sg.stage_module(m)
        have = sg.placeholders(m)
        for v in args[m][len(sg.calls[m].args):]:
            with sub.graph.inserting_after(have[-1]):
                p = sub.graph.placeholder(f"carried_{v.name}")
            p.meta.update(meta_of[v])
            have.append(p)


def _return_next_inputs(sg: _SplitGraph, m: int, args: list[list], carried: dict[int, list[str]]) -> list:
    """Step 3: stage m (not the last) returns exactly what stage m + 1 takes, in that order: its own
    outputs, and what it carries as copies (names added to carried[m]). Returns the new outputs."""
    sub = sg.stage_module(m)
    out = next(o for o in sub.graph.nodes if o.op == "output")
    res = out.args[0]
    res = list(res) if isinstance(res, (tuple, list)) else res
    mine = dict(zip(args[m], sg.placeholders(m)))
    values = []
    for v in args[m + 1]:
        if sg.producer(v) == m:  # its own output: the tuple element (or the whole output) v names
            if v is sg.calls[m]:
                values.append(res)
            elif v.args[0] is sg.calls[m] and isinstance(res, list):
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
    return values


def _read_back(sg: _SplitGraph, m: int, k: int) -> list:
    """The split graph reads stage m's k outputs back one by one, in order (torch numbers a stage's
    outputs by the order of its getitem users); returns those getitem nodes."""
    after = sg.calls[m]
    getitems = []
    for i in range(k):
        with sg.graph.inserting_after(after):
            after = sg.graph.call_function(operator.getitem, (sg.calls[m], i))
        getitems.append(after)
    return getitems
