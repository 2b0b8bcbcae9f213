"""Live ranks: a pool of torchrun ranks that keeps running between notebook cells.

pool.py (`Ranks`, `RanksError`), cell.py (one cell in flight), job.py (the torchrun launch), channel.py (the
authenticated Unix socket), rank.py (the rank side), output.py (live output), magics.py (`%%ranks`).
"""

from .pool import Ranks, RanksError

__all__ = ["Ranks", "RanksError"]
