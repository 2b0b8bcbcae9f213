"""Live ranks: a pool of torchrun ranks that keeps running between notebook cells.

pool.py (`Ranks`), failure.py (`RanksError`: how a failed cell is told), cell.py (one cell in flight), job.py
(the torchrun launch), channel.py (the authenticated Unix socket), rank.py (the rank side), output.py (live
output), magics.py (`%%ranks`),
choose.py (a schedule and m chosen under an activation cap, each candidate measured and checked on the pool).
Taught in notebook 00 (live ranks), used by 01-02 (stages typed by hand) and 04-05 (every schedule stepped;
05 chooses one with choose.py).

May import: labkit.core, labkit.versions, labkit.logs, labkit.schedules, labkit.spans, labkit.config,
labkit.worker (the rank side), labkit.check (choose's check_step), labkit.timeline, labkit.launching (the
torchrun launch of the pool).
"""

from ..core import exports as _exports

__getattr__, __dir__, __all__ = _exports(__name__, {".pool": ("Ranks", "RanksError", "current")})
