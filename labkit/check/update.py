"""The optimizer's update replayed: what the user's optimizer class does with the weights a step began
from, the gradients it saw, the state it held and the hyperparameters in effect (learning rate, weight
decay...), run again on copies, in the parameters' dtype and in float64 (the float noise of the update,
as labkit.check.noise measures a gradient's). Used by `labkit.watch_run` (labkit.check.watch).

Also the fingerprints the run watch keeps of every step between its checks: a state's or a weight's
float64 sum and its dot with a fixed random sign vector, cheap enough for every step.

May import: torch, labkit.versions, labkit.check (noise, spill)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from labkit.versions import float64_norms, unchanged_token

from .noise import NOISE_MULTIPLE, figure
from .spill import store

GROUP_SKIP = ("params",)


def hyper(group: dict) -> dict:
    """A param group's hyperparameters as plain values (a tensor lr read as a float), its params left out."""
    out = {}
    for k, v in group.items():
        if k in GROUP_SKIP:
            continue
        out[k] = float(v) if torch.is_tensor(v) and v.numel() == 1 else v
    return out


def replay(cls, groups: list[dict], weights: list[list[torch.Tensor]], grads: list[list[torch.Tensor | None]],
           states: list[list[dict]], device, dtype: torch.dtype | None = None, keep_states: bool = True):
    """One `cls.step()` on copies: group i holds `weights[i]` with `grads[i]` and `states[i]` (host
    tensors), its hyperparameters `groups[i]` (`hyper`). `dtype`: the copies cast to it (float64, the
    truth), with foreach and fused off (plain loops: float64 everywhere). Returns (new weights, new
    states), per group, as device tensors (the states None with `keep_states` False: not copied out)."""
    params, opt_groups = [], []
    for h, ws, gs in zip(groups, weights, grads):
        ps = []
        for w, g in zip(ws, gs):
            p = torch.nn.Parameter(w.detach().to(device, dtype or w.dtype, copy=True))
            p.grad = None if g is None else g.detach().to(device, p.dtype, copy=True)
            ps.append(p)
        h = dict(h)
        if dtype is not None:
            h.update({k: False for k in ("foreach", "fused", "capturable") if k in h})
            h["foreach"] = False if "foreach" in h else h.get("foreach")
        opt_groups.append({**h, "params": ps})
        params.append(ps)
    opt = cls(opt_groups)
    for ps, sts in zip(params, states):
        for p, st in zip(ps, sts):
            if st:
                opt.state[p] = {k: _state_value(k, v, p) for k, v in st.items()}
    opt.step()
    new_states = None if not keep_states else [
        [{k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()} for p in ps]
        for ps in params]
    return [[p.detach() for p in ps] for ps in params], new_states


def _state_value(key: str, v, p: torch.Tensor):
    """A state entry placed as Optimizer.load_state_dict places it: a scalar `step` kept as it is (float32
    on the host, as Adam keeps it), other floating tensors in the parameter's dtype and device."""
    if not torch.is_tensor(v):
        return v
    if key == "step" and v.dim() == 0:
        return v.clone()
    return v.to(p.device, p.dtype if v.is_floating_point() else v.dtype, copy=True)


_EPS64 = float(torch.finfo(torch.float64).eps)
SIGNS_CACHED = 1 << 22
"""Sign vectors up to this many elements are kept (one per size and device: the run watch fingerprints every
parameter and state tensor at every step, and a model has few distinct sizes); larger ones are drawn again."""
_SIGNS: dict = {}


def _signs(n: int, device) -> torch.Tensor:
    key = (n, str(device))
    if key in _SIGNS:
        return _SIGNS[key]
    g = torch.Generator().manual_seed(1234567 + n)
    v = torch.randint(0, 2, (n,), generator=g, dtype=torch.int8).to(device, torch.float64) * 2 - 1
    if n <= SIGNS_CACHED:
        _SIGNS[key] = v
    return v


def _sign_of_one() -> float:
    return float(_signs(1, "cpu")[0])


def print_of(t: torch.Tensor) -> tuple[float, float, float]:
    """A tensor's fingerprint: its float64 sum, its dot with a fixed random sign vector, its float64 norm."""
    if t.numel() == 1:  # a scalar (an optimizer's step count): the same three numbers, bit for bit, without three
        v = float(t.detach().reshape(()).to(torch.float64).item())  # reductions (a few microseconds each, every step)
        return 0.0 + v, 0.0 + v * _sign_of_one(), abs(v)
    flat = t.detach().reshape(-1).to(torch.float64)
    return float(flat.sum()), float(flat @ _signs(flat.numel(), flat.device)), float(flat.norm())


def state_prints(states: list[dict]) -> list[tuple]:
    """Each optimizer state's fingerprint: its entries' names, each tensor's float64 norm (all of them in ONE
    call: labkit.versions.float64_norms), a number as is. The same values give the same numbers bit for bit
    (a state lost, cleared, zeroed or built again does not); the norm alone, as the watch fingerprints every
    state at every step (bench/RESULTS.md, "The run watch")."""
    tensors = [v for st in states for v in st.values() if torch.is_tensor(v)]
    norms = iter(_on_host(float64_norms(tensors)))
    return [tuple(sorted((k, next(norms)) if torch.is_tensor(v) else (k, v) for k, v in st.items()))
            for st in states]


def _on_host(scalars: list[torch.Tensor]) -> list[float]:
    """0-d tensors as floats, one transfer a device (an optimizer's state is on several: Adam's `step` stays on
    the host beside moments on the GPU)."""
    out: list[float] = [0.0] * len(scalars)
    by_device: dict = {}
    for i, v in enumerate(scalars):
        by_device.setdefault(v.device, []).append(i)
    for idx in by_device.values():
        for i, v in zip(idx, torch.stack([scalars[i] for i in idx]).tolist()):
            out[i] = v
    return out


def held_state(state: dict) -> tuple[dict, dict]:
    """An optimizer state as it stands: its entries (the tensors themselves, held) and each tensor's
    `unchanged_token`, for `same_state` at the next step."""
    return dict(state), {k: unchanged_token(v) for k, v in state.items() if torch.is_tensor(v)}


def same_state(held: tuple[dict, dict] | None, state: dict) -> bool:
    """True where `state` is the held one untouched: the same entries, the same tensor objects, none written
    since (their tokens equal; a token that cannot be read: not known, False)."""
    if not held:
        return False
    entries, tokens = held
    if entries.keys() != state.keys():
        return False
    for k, v in state.items():
        if torch.is_tensor(v):
            if v is not entries[k] or tokens.get(k) is None or unchanged_token(v) != tokens[k]:
                return False
        elif not same_value(v, entries[k]):
            return False
    return True


def same_print(a, b) -> bool:
    """Two fingerprints of the same values (taken in another order on another device at most): equal
    within float64's rounding of the sums they hold."""
    if type(a) is not type(b):
        return False
    if isinstance(a, tuple):
        if len(a) != len(b):
            return False
        if len(a) == 3 and all(isinstance(v, float) for v in a + b):  # (sum, signed sum, norm)
            eps = _EPS64 * 64 * max(abs(a[2]), abs(b[2]), 1e-300)
            return all(abs(x - y) <= eps * max(1.0, abs(x) / max(abs(a[2]), 1e-300)) for x, y in zip(a, b))
        return all(same_print(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return a == b or (a != a and b != b)
    return a == b


def same_value(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (a != a and b != b)
    return a == b


def fit2(seen: dict, ref: dict, prev: dict, names: list[str]) -> tuple[float, float]:
    """Least squares seen = a R + b prev over `names` (float64); (a, b)."""
    rr = rp = pp = gr = gp = 0.0
    for n in names:
        g, r, p = seen.get(n), ref.get(n), prev.get(n)
        if g is None or r is None or p is None:
            continue
        g, r, p = (t.detach().to("cpu", torch.float64).reshape(-1) for t in (g, r, p))
        rr, rp, pp = rr + float(r @ r), rp + float(r @ p), pp + float(p @ p)
        gr, gp = gr + float(g @ r), gp + float(g @ p)
    det = rr * pp - rp * rp
    if det <= 0:
        return 0.0, 0.0
    return (gr * pp - gp * rp) / det, (gp * rr - gr * rp) / det


REPLAY_ELEMENTS = 1 << 18
"""The update is replayed this many parameter elements at a time (a parameter larger than that alone): each
replay copies its weights, gradients and state (the step's dtype, then float64) and the optimizer's own
temporaries come on top, about 60 bytes an element of a piece with Adam, so a stage's whole update at once would
add about nine copies of its parameters at a check (an optimizer's update is one parameter at a time: the same
numbers in pieces). Measured 2026-12-06, AdamW on 24 tensors of 1M elements (96 MB) on the CPU, the optimizer's
code loaded first: the replays' peak above what was held 897 MB at once, 224 MB in pieces of 4M elements, 52-72 MB
in pieces of one tensor (1M); with a stage of 12 MB at a check of the run watch (slices=), pieces of 4M elements
made the watch's peak, 256K elements left it to check_stages' chains (docs/live-ranks.md, "Memory")."""


def replay_chunks(by_group: dict[int, list[str]], weights: dict) -> list[tuple[list[int], list[list[str]]]]:
    """The names of `by_group` ({param group: names}) in pieces of at most REPLAY_ELEMENTS elements: each a
    (group indices, names per group) as `replay` takes them."""
    out, gi, names, size = [], [], [], 0
    for g in sorted(by_group):
        for n in by_group[g]:
            numel = weights.numel(n) if hasattr(weights, "numel") else weights[n].numel()  # a snapshot store's: unread
            if size and size + numel > REPLAY_ELEMENTS:
                out.append((gi, names))
                gi, names, size = [], [], 0
            if not gi or gi[-1] != g:
                gi.append(g)
                names.append([])
            names[-1].append(n)
            size += numel
    if gi:
        out.append((gi, names))
    return out


def _update_figure(n: str, k: int, before: torch.Tensor, live, after, w_dt: torch.Tensor, w_64: torch.Tensor):
    """(err, floor, not moved) of one parameter's update: the live weights against the replay (`live`, at a
    checked step), or the fingerprint the step left (`after`, between checks)."""
    if after is None:
        actual = live.detach()
        f = figure("update", n, k, actual, w_dt, w_64, 1, dtype=actual.dtype)
        still = bool(torch.equal(actual.cpu(), before)) and not torch.equal(w_dt.cpu(), before)
        return f.err, f.floor, still
    a, r, t = after.get(n), print_of(w_dt), print_of(w_64)
    err = max(abs(a[0] - r[0]), abs(a[1] - r[1])) if a else float("inf")
    floor = max(abs(t[0] - r[0]), abs(t[1] - r[1])) + float(torch.finfo(w_dt.dtype).eps) * r[2]
    return err, floor, a is not None and same_print(a, print_of(before))


def judge_update(w, st, weights: dict, states: dict | None, after, dist_: dict):
    """The update of step `st` replayed (`w`: the RunWatch): the optimizer's class, the hyperparameters in
    effect and the state it held, in the parameters' dtype and float64, against the weights after the step."""
    cls = getattr(st, "cls", type(w.optimizer))
    group_of = getattr(st, "group_of", {})
    ok, stage, what = True, None, ""
    new_w, new_s = store(w.spill), store(w.spill)
    if not st.groups or states is None:
        return new_w, new_s, True, None, ""
    live_now = {n: p for ps in w.params.values() for n, p in ps} if after is None else {}
    bad = {}
    for k, ps in w.params.items():
        by_group: dict[int, list[str]] = {}
        for n, _ in ps:
            if n in group_of:
                by_group.setdefault(group_of[n], []).append(n)
        worst = (0.0, 1.0, "", False)
        for gi, names in replay_chunks(by_group, weights):  # a few parameters at a time: bounded memory
            groups = [st.groups[i] for i in gi]
            ws = [[weights[n] for n in ns] for ns in names]  # read once (kept off memory: from the file)
            gs = [[st.seen.get(n) for n in ns] for ns in names]
            ss = [[(states or {}).get(n, {}) for n in ns] for ns in names]
            # a replay between checks chains each step's weights and state into the next; a live check keeps none
            w_dt, s_dt = replay(cls, groups, ws, gs, ss, w.device, keep_states=after is not None)
            w_64, _ = replay(cls, groups, ws, gs, ss, w.device, torch.float64, keep_states=False)
            for i, ns in enumerate(names):
                for j, n in enumerate(ns):
                    if after is not None:
                        new_w[n], new_s[n] = w_dt[i][j], s_dt[i][j]  # copies to the host (or its file)
                    err, floor, still = _update_figure(n, k, ws[i][j], live_now.get(n), after, w_dt[i][j],
                                                       w_64[i][j])
                    if err / floor > worst[0] / worst[1] or not worst[2]:
                        worst = (err, floor, n, still)
            del w_dt, s_dt, w_64, ws, gs, ss
        if worst[2]:
            e, f0 = dist_.get(k, (0.0, 1.0))
            if worst[0] / worst[1] > e / f0:
                dist_[k] = (worst[0], worst[1])
            if worst[0] > NOISE_MULTIPLE * worst[1]:
                bad[k] = worst
    parts = [None] * dist.get_world_size(w.group)
    dist.all_gather_object(parts, {k: (v[0], v[1], v[2], v[3]) for k, v in bad.items()}, group=w.group)
    bad = {k: v for p in parts for k, v in p.items()}
    if bad:
        ok = False
        stage = min(bad)
        err, floor, n, still = bad[stage]
        if still:
            what = (f"stage {stage}'s {n!r} was not updated by the step ({cls.__name__}.step "
                    f"moves it: its gradient was None at the step, or it is not the optimizer's)")
        else:
            what = (f"the update of stage {stage}'s {n!r} is not what {cls.__name__}.step gives "
                    f"from the weights at begin, the gradients it saw, its state and the learning rate in effect "
                    f"({err / floor:.3g}x its floor): weights changed outside the optimizer's step, or an update "
                    f"applied twice")
    return new_w, new_s, ok, stage, what
