"""Solutions to the exercises of notebook 06 (reading the pipelining logs). Try them first!"""

from labkit.logs import log_files, parse_files


def start_order(events, rank):
    """The runtime prints `running time_step t, action a` BEFORE each action: those are the START
    events (mark "start", origin "runtime"). Keep the compute kinds; SEND/RECV/UNSHARD/... are not
    compute. Events of one rank come in the order they were logged."""
    return [(e.kind, e.stage, e.microbatch) for e in events
            if e.rank == rank and e.mark == "start" and e.kind in ("F", "B", "I", "W")]


def exercise_2(fixtures):
    """GPipe's rank 1 prints, for each of its 4 forwards, the stage's `[Stage 1] Forwarded chunk i`
    AND the schedule's `[1] Forwarded microbatch i`: 2 x 4 = 8 END lines of kind F."""
    events = parse_files(log_files(fixtures / "GPipe-p2-m4"))
    return sum(1 for e in events if e.rank == 1 and e.mark == "end" and e.kind == "F")

