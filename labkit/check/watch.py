"""A run, not a step: `labkit.watch_run`, the first step where a training run went wrong, its optimizer included.

    watch = labkit.watch_run(stages, optimizer, loss_fn, n_microbatches, full=model, every=1)
    # or, for a model no rank holds whole: slices={stage_index: this rank's slice of the unsplit model}
    for step in range(n):
        watch.begin(x, y)      # the whole batch of this step
        ...                    # the user's own step: schedule.step, clipping, optimizer.step, lr scheduler, zero_grad
        watch.end(losses)      # collective
    r = watch.report           # .ok, .first_wrong_step, .stage, .failure, .steps

What it holds, at each checked step (every `every` steps), re-anchored on the weights the pipeline held at
`begin` (so earlier rounding does not compound):

- the gradients the optimizer saw (read by a step pre-hook on the optimizer, after the user's clipping)
  against the unsplit model's on the whole batch from those weights (labkit.check.gradients: check_step's
  three references and floors, each reference made by one rank and its gradients sent to the ranks that
  hold them), up to ONE factor over every stage: clipping by the global norm (a factor
  <= 1); a factor per stage is clipping by a stage's own norm; gradients that are the step's plus the
  previous step's are gradients not zeroed; any other failure placed as check_step places it (what a
  stage received, the module where a stage's float64 replay departs: labkit.check.located);
- the update: the user's optimizer class replayed (labkit.check.update) from the weights at begin, the
  gradients it saw, its state and the hyperparameters in effect, in the parameters' dtype and in float64
  (the floor), against what each stage's weights became.

At EVERY step, from fingerprints (labkit.check.update: print_of, state_prints; taken again only where a tensor
was written since, labkit.versions.unchanged_token): the optimizer's state against what the previous step
left (lost or replaced state), the learning rate and every other hyperparameter of each param
group the same on every stage (a scheduler stepped once more on one rank), optimizer.step called once, the
weights unchanged between steps. Between checks the watch keeps, on the host, each step's batch and the
gradients its optimizer saw; when a check fails it replays from the first step after the last good check (its
weights and optimizer state at its begin kept on the host), step by step, and names the exact first wrong step.
A good check lets go of everything held before it but its own gradients (the next step's are held against them).

With `slices=` (a model no rank holds whole, as labkit.check_stages takes it: each rank passes only its
slices, built as the unsplit model's layers are, never the stage modules) a check re-anchors each rank's slices
on its stages' weights at `begin` (the watch sets their values from then on) and runs check_stages' three
chains along the pipeline (labkit.check.stagewise.references: each rank only its slices, activations and
their gradients sent between the ranks), read as the full model's references are; the update is judged per
stage as with full=, and a gradient failure is placed by check_stages' float64 replay of each stage against
its slice. The watch then holds no copy of the model, only check_stages' need beside its slices; the snapshots
above are kept off memory (labkit.check.spill; `spill=` chooses; with full= held in memory by default). The last
stage's rank must pass its losses to `end`, as check_stages needs them.

Needs: the model has no randomness (dropout) the reference cannot repeat; `end` after optimizer.step (the
weights it reads are the step's result); the optimizer holds the stages' parameters. Not yet: tied weights.

May import: torch, labkit.versions, labkit.check (gradients, calls, boundaries, update, runs, fits, noise, spill,
stagewise)."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from . import fits, gradients
from . import spill as spill_
from . import update as upd
from .boundaries import stage_names
from .noise import canonical
from .calls import CheckStepError
from labkit.versions import unchanged_token

from .runs import Drift, RunReport, StepRecord, plot_run  # noqa: F401  (this API's)


@dataclass
class _Step:
    """What the watch keeps of one step on this rank."""

    step: int
    x: object
    y: object
    kwargs: dict
    w_print: dict = field(default_factory=dict)          # name -> fingerprint of the weights at begin
    weights: Mapping | None = None                       # name -> host copy at begin (anchors; labkit.check.spill)
    seen: Mapping = field(default_factory=dict)          # name -> host copy of the gradient the optimizer saw
    groups: list = field(default_factory=list)           # each param group's hyperparameters at the step
    states: Mapping | None = None                        # name -> host copy of the state the step used (anchors)
    s_pre: dict = field(default_factory=dict)            # name -> state fingerprint before the update
    s_post: dict = field(default_factory=dict)           # name -> state fingerprint after it
    after: dict = field(default_factory=dict)            # name -> fingerprint of the weights after the step
    w_tokens: dict = field(default_factory=dict)         # name -> the weights' unchanged_token after the step
    s_held: dict = field(default_factory=dict)           # name -> the state after the update, held (upd.held_state)
    calls: int = 0
    losses: list = field(default_factory=list)


class RunWatch:
    """The watch of one training run on this rank (`labkit.watch_run`)."""

    def __init__(self, stages, optimizer, loss_fn, n_microbatches: int, full: nn.Module | None = None, *,
                 slices=None, every: int = 1, chunk_dim: int = 0, autocast: torch.dtype | None = None,
                 group=None, prefix_stage_index: bool | None = None, device=None, spill: bool | str | None = None):
        stages = list(stages) if isinstance(stages, (list, tuple)) else [stages]
        problems = []
        if (full is None) == (slices is None):
            problems.append("watch_run needs the unsplit model on every rank: whole (full=, with its initial weights), "
                            "or, for a model no rank holds whole, this rank's slices of it (slices={stage_index: "
                            "that stage's slice}, as labkit.check_stages takes them): pass one of the two")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            problems.append(f"every must be a whole number >= 1 (check every k-th step), got {every!r}")
        if spill_.problem(spill):
            problems.append(spill_.problem(spill))
        if problems:  # from the arguments alone: the same on every rank, before any collective
            raise CheckStepError("; ".join(problems))
        self.stages, self.optimizer, self.loss_fn, self.n_microbatches = stages, optimizer, loss_fn, n_microbatches
        self.every, self.chunk_dim, self.autocast, self.group = every, chunk_dim, autocast, group
        self.device = device if device is not None else (stages[0].device if stages else "cpu")
        self.slices = dict(slices) if slices is not None else None
        # the host snapshots kept off memory (labkit.check.spill): by default where memory is the point (slices=)
        self.spill = spill_.resolved(spill, slices is not None)
        self._fits(full, stages, optimizer, every, group, device)
        # each rank's stages' parameter names, gathered: whom a reference's gradients go to, and (slices=) whether
        # two stages name theirs alike (each built from one block class): then each name is prefixed by its stage
        held = [None] * dist.get_world_size(group)
        dist.all_gather_object(held, {int(s.stage_index): [n for n, _ in s.submod.named_parameters()] for s in stages},
                               group=group)
        if prefix_stage_index is None and full is not None:
            names = {n for n, _ in full.named_parameters()}
            prefix_stage_index = not all(k in names for s in stages for k, _, _ in stage_names(s, False))
        elif prefix_stage_index is None:
            every_name = [canonical(n) for h in held for ns in h.values() for n in ns]
            prefix_stage_index = len(set(every_name)) < len(every_name)
        self.prefix = prefix_stage_index
        named = lambda k, n: canonical(f"{k}.{n}" if prefix_stage_index else n)  # noqa: E731  (stage_names')
        self.names_of = [{named(k, n) for k, ns in h.items() for n in ns} for h in held]
        self.params = {s.stage_index: [(name, p) for _, name, p in stage_names(s, prefix_stage_index)] for s in stages}
        self.stage_of = {name: k for k, ps in self.params.items() for name, _ in ps}
        self.by_id = {id(p): name for ps in self.params.values() for name, p in ps}
        self.full = copy.deepcopy(full).to(self.device) if full is not None else None
        if self.slices is not None:  # each name's (stage, name in its slice) and the slice's parameter it re-anchors
            self.slice_key, self.slice_of = {}, {}
            for s in stages:
                k = int(s.stage_index)
                theirs = dict(self.slices[k].named_parameters())
                theirs = {canonical(n): p for n, p in theirs.items()}
                for n, _ in s.submod.named_parameters():
                    self.slice_key[named(k, n)] = (k, canonical(n))
                    self.slice_of[named(k, n)] = theirs[canonical(n)]
        self.report = RunReport(every=every)
        self._step: _Step | None = None
        self._pending: list[_Step] = []   # the steps since the last good check (the first one an anchor)
        self._last: _Step | None = None   # the previous step (its state and weights fingerprints)
        self._t = -1
        # global hooks: an optimizer built again (a resume) is still seen, by the parameters it holds
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._hooks = [register_optimizer_step_pre_hook(self._pre), register_optimizer_step_post_hook(self._post)]

    def _fits(self, full, stages, optimizer, every: int, group, device) -> None:
        """Refused up front, as check_step refuses, when the watch cannot fit on a rank (labkit.check.fits), and,
        with slices=, when a rank's slices do not match its stages (check_stages' words): every rank's report
        gathered by one collective, the same CheckStepError on every rank."""
        own = [p for s in stages for p in s.submod.parameters()]
        n_state = max((len([v for v in st.values() if torch.is_tensor(v) and v.dim()])
                       for st in optimizer.state.values()), default=2)  # Adam's two moments before the first step
        dev = device if device is not None else (stages[0].device if stages else "cpu")
        problems, sixteen = [], False
        if self.slices is not None:
            from .stagewise import _Run, _sixteen, _slice_problems

            run = _Run(self.slices, stages, None, None, [], self.n_microbatches, self.loss_fn, self.autocast, {},
                       torch.device(dev), self.chunk_dim, group)
            problems, sixteen = _slice_problems(run), _sixteen(run)
        folder = spill_.folder(self.spill)
        too_large = fits.watch_too_large(full, own, every, dev, n_state, self.slices, sixteen, folder)
        said = [None] * dist.get_world_size(group)
        dist.all_gather_object(said, (full is None, problems, too_large), group=group)
        ranks = [dist.get_global_rank(group, r) if group is not None else r for r in range(len(said))]
        found = [f"rank {ranks[r]}: {p}" for r, (_, ps, _) in enumerate(said) for p in ps]
        found += [f"rank {ranks[r]}: {t}" for r, (_, _, t) in enumerate(said) if t][:1]
        if len({sliced for sliced, _, _ in said}) > 1:
            found.insert(0, "some ranks passed full= and others slices=: pass the same one on every rank")
        if found:
            raise CheckStepError("watch_run cannot watch this run (the same on every rank of the pipeline): "
                                 + "; ".join(found))

    # -- the user's two calls -------------------------------------------------------------------------------
    def begin(self, x, y=None, **kwargs) -> None:
        """Before the step: its whole batch (the model's other inputs as keywords)."""
        self._t += 1
        host = lambda v: v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v  # noqa: E731
        st = _Step(self._t, host(x), host(y), {k: host(v) for k, v in kwargs.items()}, seen=spill_.store(self.spill))
        # weights untouched since the last step's end (same storage, no write since): its fingerprints, not taken again
        last, tokens = self._last, {n: unchanged_token(p) for ps in self.params.values() for n, p in ps}
        if last is not None and last.after and None not in tokens.values() and tokens == last.w_tokens:
            st.w_print = last.after
        else:
            st.w_print = {n: upd.print_of(p) for ps in self.params.values() for n, p in ps}
        # an anchor, kept on the host until the next good check: a checked step's own weights (its live check),
        # and those of the first step after a good check (a failed check replays from there)
        if self.report.first_wrong_step is None and (self._checked(self._t) or not self._pending):
            st.weights = spill_.taken(self.spill, ((n, p) for ps in self.params.values() for n, p in ps))
        self._step = st

    def end(self, losses=None) -> None:
        """After the step (after optimizer.step; zero_grad before or after it): collective, every rank."""
        st = self._step
        if st is None:
            raise CheckStepError("watch.end() without watch.begin(x, y) before it in this step")
        st.losses = [float(v.detach()) if torch.is_tensor(v) else float(v) for v in (losses or [])]
        st.after = {n: upd.print_of(p) for ps in self.params.values() for n, p in ps}
        st.w_tokens = {n: unchanged_token(p) for ps in self.params.values() for n, p in ps}
        done = self.report.first_wrong_step is not None
        mine = self._cheap(st)
        gathered = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, mine, group=self.group)
        rec = self._record(st, gathered)
        st.prev_seen = self._last.seen if self._last is not None else None
        if self._last is not None:
            self._last.s_held = {}  # the previous step's state tensors no longer held
        self._step, self._last = None, st
        if done:
            return
        self._pending.append(st)
        wrong = self._every_step(st, gathered, rec)
        if wrong is not None or self._checked(st.step):
            self._check(rec, upto=st.step, cheap=wrong)

    def close(self) -> None:
        """The optimizer's hooks removed."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for held in (h for s in self._pending + [self._last] if s for h in (s.weights, s.states, s.seen) if h):
            held.close()  # the snapshots' files closed (gone from the disk)
        self._pending = []

    # -- the optimizer's hooks ------------------------------------------------------------------------------
    def _pre(self, opt, args, kwargs) -> None:
        st = self._step
        if st is None or not self._mine(opt):
            return
        st.calls += 1
        st.cls, self._opt = type(opt), opt
        if st.calls > 1:
            return
        st.groups = [upd.hyper(g) for g in opt.param_groups]
        st.group_of = {self.by_id[id(p)]: i for i, g in enumerate(opt.param_groups) for p in g["params"]
                       if id(p) in self.by_id}
        last = self._last
        held = last.s_held if last is not None and last.s_post else {}
        again = {}
        for ps in self.params.values():
            for n, p in ps:
                st.seen[n] = p.grad  # a copy, taken now
                state = opt.state.get(p, {})
                # the same state tensors, untouched since the previous step's update: its fingerprint, not
                # taken again; else taken and compared (a state loaded again with the same values holds)
                if upd.same_state(held.get(n), state):
                    st.s_pre[n] = last.s_post[n]
                else:
                    again[n] = state
        st.s_pre.update(zip(again, upd.state_prints(list(again.values()))))
        if st.weights is not None:  # an anchor's state, as its weights (begin)
            st.states = spill_.taken(self.spill, ((n, opt.state.get(p, {})) for ps in self.params.values()
                                                  for n, p in ps))

    def _post(self, opt, args, kwargs) -> None:
        st = self._step
        if st is None or st.calls > 1 or not self._mine(opt):
            return
        names = [n for ps in self.params.values() for n, _ in ps]
        states = [opt.state.get(p, {}) for ps in self.params.values() for _, p in ps]
        st.s_post = dict(zip(names, upd.state_prints(states)))
        st.s_held = {n: upd.held_state(opt.state.get(p, {})) for ps in self.params.values() for n, p in ps}

    def _mine(self, opt) -> bool:
        return any(id(p) in self.by_id for g in opt.param_groups for p in g["params"])

    # -- every step: fingerprints ---------------------------------------------------------------------------
    def _checked(self, t: int) -> bool:
        return t % self.every == 0

    def _cheap(self, st: _Step) -> dict:
        """This rank's evidence of the step, gathered by every rank."""
        last = self._last
        lost = sorted({self.stage_of[n] for n, pr in st.s_pre.items()
                       if last is not None and last.s_post and not upd.same_print(pr, last.s_post.get(n))})
        moved = sorted({self.stage_of[n] for n, pr in st.w_print.items()
                        if last is not None and last.after and not upd.same_print(pr, last.after.get(n))})
        missing = sorted({self.stage_of[n] for n in self.stage_of if st.calls and n not in getattr(st, "group_of", {})})
        opt = getattr(self, "_opt", self.optimizer)
        st.next_groups = [upd.hyper(g) for g in opt.param_groups]  # set for the next step (a scheduler stepped)
        return {"stages": sorted(self.params), "calls": st.calls, "groups": st.groups, "lost": lost,
                "next": st.next_groups,
                "moved": moved, "missing": missing, "losses": st.losses,
                "last": any(s.is_last for s in self.stages)}

    def _record(self, st: _Step, gathered: list[dict]) -> StepRecord:
        losses = next((g["losses"] for g in gathered if g["last"] and g["losses"]), [])
        first = min(range(len(gathered)), key=lambda r: min(gathered[r]["stages"], default=1 << 30))
        lr = [float(g.get("lr", float("nan"))) for g in gathered[first]["groups"]]
        rec = StepRecord(st.step, sum(losses) / len(losses) if losses else None, lr)
        self.report.steps.append(rec)
        return rec

    def _every_step(self, st: _Step, gathered: list[dict], rec: StepRecord) -> tuple | None:
        """(stage, what) of the first thing the fingerprints show wrong at this step, or None."""
        first_stage = lambda r: min(gathered[r]["stages"], default=r)  # noqa: E731
        for r, g in enumerate(gathered):
            if g["calls"] != 1:
                return first_stage(r), (f"optimizer.step ran {g['calls']} times on rank {r} in this step (once "
                                        f"expected): {'not called' if g['calls'] == 0 else 'an extra step'}")
        for r, g in enumerate(gathered):
            if g["missing"]:
                return g["missing"][0], (f"a parameter of stage {g['missing'][0]} is in none of the optimizer's "
                                         f"param groups: it is never updated")
        for r, g in enumerate(gathered):
            if g["lost"]:
                return g["lost"][0], (f"the optimizer state of stage {g['lost'][0]} is not what the previous step "
                                      f"left (lost or replaced: a state cleared, an optimizer built again, a "
                                      f"checkpoint's state not loaded)")
        for r, g in enumerate(gathered):
            if g["moved"]:
                return g["moved"][0], (f"the weights of stage {g['moved'][0]} changed between the previous step's "
                                       f"end and this step's begin (loaded or edited outside the optimizer's step)")
        said = self._hyper_disagree(gathered, "groups", "in effect at this step")
        return said or self._hyper_disagree(gathered, "next", "set at the end of this step for the next")

    def _hyper_disagree(self, gathered: list[dict], which: str, when: str) -> tuple | None:
        """Each param group's hyperparameters must be the same on every stage (`which`: those in effect at the
        step, or those set for the next one when the step ends)."""
        n = min(len(g[which]) for g in gathered)
        prev = self.report.steps[-2].lr if len(self.report.steps) > 1 and which == "groups" else \
            self.report.steps[-1].lr
        for i in range(n):
            for key in gathered[0][which][i]:
                vals = [g[which][i].get(key) for g in gathered]
                if all(upd.same_value(v, vals[0]) for v in vals):
                    continue
                # the odd one out: the minority; on a tie, the one that moved farthest from the previous step's
                counts = [sum(upd.same_value(v, w) for w in vals) for v in vals]
                least = min(counts)
                odd = [r for r, c in enumerate(counts) if c == least]
                if len(odd) > 1 and key == "lr" and prev and i < len(prev):
                    odd = [max(odd, key=lambda r: abs(float(vals[r]) - prev[i]))]
                r = odd[0]
                stage = min(gathered[r]["stages"], default=r)
                said = ", ".join(f"stage {min(g['stages'], default=q)}: {v!r}" for q, (g, v) in
                                 enumerate(zip(gathered, vals)))
                kind = {"lr": "the learning rate", "weight_decay": "weight decay"}.get(key, f"the optimizer's {key!r}")
                hint = (" (an lr scheduler stepped a different number of times on that rank)" if key == "lr" else "")
                return stage, f"{kind} of param group {i} {when} differs between stages ({said}){hint}"
        return None

    # -- a check: re-anchored references, replayed from the last good check when it fails ----------------------
    def _check(self, rec: StepRecord, upto: int, cheap: tuple | None) -> None:
        """A checked step judged live, re-anchored on its own weights; when it fails (or the fingerprints
        showed a step wrong), the steps since the last good check replayed from it, in order: the first one
        wrong is the run's first wrong step. The same on every rank (collectives in lockstep)."""
        pend, st = self._pending, self._pending[-1]
        if cheap is None:
            ok, stage, what, _, _ = self._judge(st, st.weights, st.states, after=None)
            if ok:
                self._mark(st.step, True, None, "")
                self._held_since_good(pend)
                return
            cheap = (stage, what)  # this step's own verdict, said if no step before it was wrong
            if len(pend) == 1:
                self._mark(st.step, False, *cheap)
                return
        weights, states = pend[0].weights, pend[0].states
        for i, s in enumerate(pend[:-1]):
            if s.weights is not None:  # a snapshot re-anchors exactly
                weights, states = s.weights, s.states
            ok, stage, what, weights, states = self._judge(s, weights, states, after=s.after)
            self._mark(s.step, ok, stage, what)
            if not ok:
                return
        self._mark(st.step, False, *cheap)

    def _held_since_good(self, pend: list[_Step]) -> None:
        """After a good check: nothing of the steps up to it is held any more (their anchors, their gradients)
        but the checked step's gradients, which the next step's are held against (gradients not zeroed). The
        next step is the next anchor (`begin`)."""
        for s in pend:
            s.weights = s.states = s.prev_seen = None
        for s in pend[:-1]:
            s.seen = {}
        self._pending = []

    def _mark(self, step: int, ok: bool, stage, what: str) -> None:
        rec = next(r for r in self.report.steps if r.step == step)
        rec.checked, rec.ok, rec.what = True, ok, what
        if not ok and self.report.first_wrong_step is None:
            self.report.first_wrong_step, self.report.stage, self.report.failure = step, stage, what

    def _judge(self, st: _Step, weights: dict, states: dict | None, after):
        """One step judged from the weights it began from: its gradients against the unsplit model's, then its
        update against the optimizer's (`after`: the fingerprints the step left, between checks; None: the
        stages' weights now). Returns (ok, stage, what, the next weights, the next states) (the replay's)."""
        rec = next(r for r in self.report.steps if r.step == st.step)
        g_ok, g_stage, g_what, dist_ = gradients.judge_grads(self, st, weights, rec, live=after is None)
        new_w, new_s, u_ok, u_stage, u_what = upd.judge_update(self, st, weights, states, after, dist_)
        rec.stages = dist_
        stage, what = (g_stage, g_what) if not g_ok else (u_stage, u_what)
        return g_ok and u_ok, stage, what, new_w, new_s


def watch_run(stages, optimizer, loss_fn, n_microbatches: int, full: nn.Module | None = None, *, slices=None,
              every: int = 1, **kwargs) -> RunWatch:
    """The run watch (collective): call it on every rank before the loop, then `watch.begin(x, y)` and
    `watch.end(losses)` around each step; `watch.report` names the first wrong step, its stage and what went wrong (the
    gradients or the update), and gives each step's loss and distance from the re-anchored reference.
    `every`: check every k-th step (the others fingerprinted; a failed check replays from the last good one,
    so the exact step is still named). `full`: the unsplit model with its initial weights, on every rank; or
    `slices`: {stage_index: this rank's slice of the unsplit model} for each stage it holds (a model no rank
    holds whole: the checks run check_stages' chains; with the same names for two stages' parameters, as
    blocks of one class have, the names the watch says are prefixed by their stage unless prefix_stage_index
    says otherwise). Keywords: chunk_dim, autocast, group, prefix_stage_index, device. A run the watch cannot
    fit on a rank (its references, its host snapshots: labkit.check.fits), or slices that do not match their
    stages, are refused up front with the estimate or check_stages' words, the same CheckStepError on every
    rank."""
    return RunWatch(stages, optimizer, loss_fn, n_microbatches, full, slices=slices, every=every, **kwargs)
