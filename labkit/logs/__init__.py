"""A run's measurements read into timelines: torch's pipelining logs (messages, parse: lines -> events,
files: a run's log files and their ranks;
intervals: events -> Timeline, and how waits are taken out), where idle time went (gaps), and
torch.profiler traces (profiler).

May import: labkit.core only.
"""

_HOMES = {"gaps": ("CAUSES", "IdleReport", "explain_idle"),
          "intervals": ("WAITS", "timeline_from_path", "to_timeline", "trim_waits"),
          "messages": ("END", "START", "Event", "decode_action", "decode_message"),
          "files": ("log_files", "parse_files", "parse_run_dir", "rank_from_path"),
          "parse": ("parse_lines",),
          "profiler": ("actions_from_trace", "profile_files", "timeline_from_profile")}
_HOME = {name: module for module, names in _HOMES.items() for name in names}


def __getattr__(name):
    # Each name is imported from its module when first used: the launcher needs only the log format
    # (labkit.logs.parse), not the readers, and importing them all would slow every launch.
    from importlib import import_module

    if name in _HOME:
        return getattr(import_module(f".{_HOME[name]}", __name__), name)
    from ..core import submodules

    return submodules(__name__)(name)  # a module of the package, used as labkit.logs.gaps after `import labkit`

__all__ = [
    "CAUSES", "END", "IdleReport", "START", "WAITS", "explain_idle", "Event", "actions_from_trace", "decode_action", "decode_message", "log_files",
    "parse_files", "parse_lines", "parse_run_dir", "profile_files", "rank_from_path", "timeline_from_path",
    "timeline_from_profile", "to_timeline", "trim_waits",
]
