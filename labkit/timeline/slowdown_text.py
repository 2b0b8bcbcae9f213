"""`labkit.timeline.slowdown.Slowdown` in words: the verdict a learner reads (`text`), what `labkit
timeline --compare` prints (`report`) and the table by cause (`table`). Every cause the verdict names
(`Slowdown.named`, largest first, and `against`: what changed the other way), with its size (the
machine by its excess over the load it had, your code by each stage and kind that changed with its
ratio), then how sure: the units' spread and sign, whether they agree on the cause and about how many
units would settle it (`Slowdown.agreement`), whether the before side was a quiet baseline
(`labkit.spans.quiet`) and, where it was not, that the verdict is given on a busy baseline and what
it rests on. Notebook 06b."""

from __future__ import annotations

from .critical_path import CAUSES

KIND_NAMES = {"F": "forward", "B": "backward", "I": "input backward", "W": "weight backward"}
WORDS = {"machine": "the machine", "compute": "your code", "waiting": "waiting between actions",
         "communication": "the transfers between ranks", "kit": "the kit's own instrumentation"}


class SlowdownText:
    """The words of a `Slowdown` (which it is mixed into: it reads the verdict's fields and properties)."""

    def text(self) -> str:
        """The verdict in one paragraph a learner can act on: every cause that changed beyond its noise,
        largest first, then how sure that is (the units' spread and whether they agree on the cause,
        whether the baseline was quiet, what was not measured). `pool.compare(...).text()` and
        `labkit timeline --compare` print this same text."""
        d = self.after - self.before
        busy = self.baseline is not None and not self.baseline.ok
        return (f"The step takes {_ms(self.after)} against {_ms(self.before)} ({_ms(d, sign=True)}"
                + (f", {self.after / self.before:.2f}x" if self.before > 0 else "") + ")"
                + (" on a busy baseline" if busy else "") + ": " + self._why() + "." + self._warm() + self._sure())

    def report(self) -> str:
        """`text()`, the table by cause, and the notes: what `labkit timeline --compare` prints."""
        return "\n".join([self.text(), "", self.table()] + [f"note: {n}" for n in self.notes])

    def _why(self) -> str:
        if not any(self.delta.values()):
            return "no cause changed"
        why, against = self._why_named(), self.against
        if against and self._load():  # the machine's other way is said there already
            against = [c for c in against if c != "machine"]
        if against:
            why += (f"; but what {'grew' if self._sign < 0 else 'shrank'}: "
                    + " and ".join(self._phrase(c, -self._sign) for c in against))
        return why

    def _why_named(self) -> str:
        named = self.named
        if len(named) == 2:
            return f"both: {self._phrase(named[0])} and {self._phrase(named[1])}"
        if len(named) > 2:
            return (f"{len(named)} causes: " + "; ".join(self._phrase(c) for c in named[:-1])
                    + f"; and {self._phrase(named[-1])}")
        if named:
            return self._one(named[0])
        c = self.main
        size = self._size(c) or 0.0
        limit = self._limit(c)
        return (f"no cause changed beyond its noise (the most: {WORDS[c]}, {_ms(size, sign=True)}, within "
                f"{_ms(limit)}" + ("" if self.noise(c) else f", {self._floor:.0%} of the step") + ")")

    def _took(self, key, first: bool) -> str:
        stage, kind = key
        b, a = self.per_action.get(key, (0.0, 0.0))
        took = (f"take {a / b:.1f}x as long" if first else f"{a / b:.1f}x") if b > 0 else "appear"
        return f"stage {stage}'s {KIND_NAMES.get(kind, kind)}s {took}"

    def _top_stage(self) -> tuple[int, str] | None:
        return max(self.by_stage, key=lambda k: self._sign * self._size(k), default=None)

    def _phrase(self, cause: str, way: int | None = None) -> str:
        """One cause among several, with its size (`way`: the direction it is named for; the step's by default)."""
        if cause == "machine":
            return (f"the machine ({_ms(self.machine_excess, sign=True)} for a CPU beyond the load it had: "
                    f"{self._shares()[2]})")
        if cause == "compute":
            stages = self._stages(self._sign if way is None else way)
            if not stages:
                return f"your code ({_ms(self.delta['compute'], sign=True)} of compute on the critical path)"
            said = ", ".join(f"{self._took(k, i == 0)} ({_ms(self._size(k), sign=True)})" for i, k in enumerate(stages))
            if self.alike and (way is None or way == self._sign):
                return (f"every stage's compute alike: {said}, as on cores shared with other work (cold caches, a "
                        f"lower clock): the machine's too, unless you changed every stage")
            return "your code: " + said
        return f"{WORDS[cause]} ({_ms(self.delta[cause], sign=True)})"

    def _one(self, cause: str) -> str:
        """The one cause that changed, in a sentence of its own."""
        d = self.delta[cause]
        more, load = "more" if d >= 0 else "less", self._load()
        if cause == "compute":
            stages = self.stages or [k for k in [self._top_stage()] if k is not None]
            took = " and ".join(self._took(k, i == 0) for i, k in enumerate(stages)) or "the stages' actions"
            return (f"{took} ({_ms(abs(d))} {more} compute per step on the critical path): the code"
                    + (load or ", not the machine"))
        return {"machine": f"the ranks waited {_ms(abs(d))} {more} for a CPU: the machine, not your code (other "
                           f"processes held the cores" + (f"; {self._shares()[2]}" if self.causes["machine"][0] else "")
                           + ")",
                "waiting": f"the critical path spent {_ms(abs(d))} {more} between actions outside any transfer "
                           f"(the schedule's own Python, the loss, a wait for data it did not trace), not in any "
                           f"stage's compute",
                "communication": f"sends and receives on the critical path took {_ms(abs(d))} {more}: the "
                                 f"transfers between ranks (their size, the backend, the link)",
                "kit": f"the kit's own instrumentation took {_ms(abs(d))} {more}: the measurement, not your code",
                }[cause] + load

    def _warm(self) -> str:
        """The steps left out because torch.compile compiled in them or they warmed up (a schedule's first
        step), named apart; the sides with no warm step."""
        out = ""
        if self.left_out:
            whys = {x.why for x in self.left_out}
            did = " or ".join(w for w, why in (("compiled", "compiled"), ("warmed up", "warm-up")) if why in whys)
            out += f" Steps that {did} are left out and the warm steps are compared: " + "; ".join(
                f"{x.side}'s " + (f"round {x.round}, " if x.round else "") + f"step {x.step} "
                + (f"compiled for {_time(x.seconds)} ({_compiled(x.counts)})" if x.why == "compiled" else
                   f"warmed up for {_time(x.seconds)} (its schedule's first step)") for x in self.left_out) + "."
        for side in self.unwarm:
            out += (f" Every step of {side} compiled (torch.compile): with no warm step it is compared as it is, "
                    f"the compiler's time in it; run more steps.")
        for side in self.cold:
            out += (f" No step of {side} is warm (each is its schedule's first step in the process, or compiled): "
                    f"it is compared as it is, the set-up's time in it; run more steps.")
        return out

    def _sure(self) -> str:
        """How sure: the units' spread and agreement, the baseline, what was not measured."""
        n, unit, out = self.units, self.unit, ""
        if n > 1:
            lo, hi = self.spread["step"]
            over = (f"Over {n} rounds one round's change" if unit == "round" else
                    f"Over {n} steps each way (paired in order) one step's change")
            out += (f" {over} ran from {_ms(lo, sign=True)} to {_ms(hi, sign=True)}"
                    + (f"; every {unit} agrees on its sign." if lo * hi > 0 else
                       f"; the {unit}s disagree on its sign: measure more before acting on it."))
            ag = self.agreement
            if ag is not None and ag.second is not None:
                out += self._disagreement(ag)
        elif self.changes:
            out += (f" One {unit} each way: how much of this is noise cannot be told (measure several steps, "
                    f"or rounds: pool.rounds).")
        out += self._baseline_text()
        if self.causes["kit"][0] is None:
            out += " The kit's own time is not measured here: it sits inside the other causes, mostly waiting."
        return out

    def _disagreement(self, ag) -> str:
        n, unit = self.units, self.unit
        grew = "grew" if self._sign > 0 else "shrank"
        tally = ", ".join(f"{WORDS[c]} in {k}" + (f" of {n}" if i == 0 else "")
                          for i, (c, k) in enumerate(ag.tops.items()))
        out = f" The {unit}s disagree on which cause {grew} most ({tally})"
        first, second = WORDS[ag.first], WORDS[ag.second]
        if ag.settled:
            return out + f", but over all {n} {first} leads {second} by {_ms(ag.lead)} a {unit}, beyond its noise."
        if ag.needed is not None:
            return (out + f": {first} leads {second} by only {_ms(ag.lead)} a {unit}, within its noise; about "
                    f"{ag.needed} {unit}s would settle it ({ag.needed - n} more).")
        return (out + f": {first} and {second} {grew} by about as much; no practical number of {unit}s would "
                f"settle which more.")

    def _baseline_text(self) -> str:
        q = self.baseline
        if q is None:
            if self.causes["machine"][0] is None:
                return (" How busy the machine was is not measured (no scheduler clocks): a busy machine would "
                        "hide inside the other causes.")
            if not self.changes:  # made by hand: no steps to read a load from
                return ""
            return (" Whether the baseline was quiet cannot be told (its steps hold no load readings), so the quiet "
                    "rule (labkit.spans.quiet) does not stand behind the step's times: the verdict rests on each "
                    "action less the time its rank waited for a CPU, and that wait.")
        if q.ok:
            return f" The baseline was quiet ({q.figures()})."
        return (f" Not a quiet baseline ({q.figures()}): by the kit's rule (labkit.spans.quiet) something else kept "
                f"the machine busy, so the step's times are not compared as such; the verdict rests on what the ranks "
                f"measured, each action less the time its rank waited for a CPU, and that wait on their run-queue "
                f"clocks.")

    def _shares(self, actions: bool = False) -> tuple[float, float, str]:
        """(before, after, in words): the share of the step (of the path's actions' time) without a CPU."""
        (mb, ma), (ib, ia), (cb, ca) = self.causes["machine"], self.machine_in_actions, self.causes["compute"]
        pb, pa, of = mb / self.before, ma / self.after, "the step"
        if actions and ib is not None and ib + cb > 0 and ia + ca > 0:
            pb, pa, of = ib / (ib + cb), ia / (ia + ca), "the actions' time"
        same = f"{pb:.0%}" == f"{pa:.0%}"
        return pb, pa, f"descheduled {pa:.0%} of {of} " + ("both times" if same else f"against {pb:.0%}")

    def _load(self) -> str:
        """Where the machine, busy before too, changed with the step but is not `main`: how busy it was ('' else)."""
        (mb, ma), d = self.causes["machine"], self.after - self.before
        if self.main == "machine" or not mb or (ma - mb) * d <= 0:
            return ""
        (pb, pa, shares), excess = self._shares(actions=True), self.machine_excess
        longer = "longer" if d > 0 else "shorter"
        if abs(pa - pb) < 0.05:
            return (f"; the machine was as busy as before ({shares}): its {_ms(abs(ma - mb))} "
                    f"{'more' if d > 0 else 'less'} for a CPU came with the {longer} step")
        return (f"; the machine was {'busier than before too' if excess > 0 else 'less busy than before'} "
                f"({shares}: {_ms(abs(excess))} {'beyond' if excess > 0 else 'short of'} what the "
                f"{longer} step would wait for a CPU at the load it had)")

    def table(self) -> str:
        """Per cause (and compute per stage and kind): before, after and the change, in ms; with several
        units, the change's noise (`NOISE_Z` standard errors)."""
        rows = [("step", "step", (self.before, self.after))] + [(c, c, self.causes[c]) for c in CAUSES]
        rows[3:3] = [(f"  stage {s} {k}", (s, k), v) for (s, k), v in sorted(self.by_stage.items())]
        noisy = self.units > 1
        lines = [f"{'cause':16s} {'before ms':>10s} {'after ms':>10s} {'change ms':>10s}"
                 + (f" {'± ms':>8s}" if noisy else "")]
        for name, key, (b, a) in rows:
            cells = ("unknown",) * 3 if b is None else (f"{1e3 * b:.3f}", f"{1e3 * a:.3f}",
                                                        f"{round(1e3 * (a - b), 3) + 0.0:+.3f}")  # no "-0.000"
            line = f"{name:16s} " + " ".join(f"{c:>10s}" for c in cells)
            if noisy:
                noise = self.noise(key, raw=True)  # the row's own change (the machine's as it grew, not its excess)
                line += f" {'' if noise is None else f'{1e3 * noise:.3f}':>8s}"
            lines.append(line)
        return "\n".join(lines)


def _ms(seconds: float, sign: bool = False) -> str:
    return f"{1e3 * seconds:{'+' if sign else ''}.3g} ms"


def _time(seconds: float) -> str:
    """A step's time in ms, or in s from a second on (a step that compiled: "2.9 s", not "2.9e+03 ms")."""
    return f"{seconds:.3g} s" if seconds >= 1 else _ms(seconds)


def _compiled(counts: dict) -> str:
    """What dynamo did in a step, over the ranks that compiled: "torch.compile on ranks 0 and 1: 2 frames, 2 graphs"."""
    def total(get) -> int:
        return sum(max(0, int(get(c))) for c in counts.values())

    said = [(total(lambda c: c.get("frames", 0)), "frame", ""), (total(lambda c: c.get("graphs", 0)), "graph", ""),
            (total(lambda c: c.get("recompiles", 0)), "recompile", ""),
            (total(lambda c: c.get("fell_back", 0) - c.get("at_limit", 0)), "frame", " it could not compile")]
    ranks = sorted(int(r) for r in counts)
    where = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"
    return f"torch.compile on {where}: " + ", ".join(f"{n} {what}{'s' if n != 1 else ''}{tail}"
                                                     for n, what, tail in said if n)
