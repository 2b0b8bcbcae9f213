"""A run's measurements read into timelines: torch's pipelining logs (messages, parse: lines -> events,
files: a run's log files and their ranks;
intervals: events -> Timeline, and how waits are taken out), where idle time went (gaps), and
torch.profiler traces (profiler).

May import: labkit.core only.
"""

from ..core import exports as _exports

# the launcher needs only the log format (labkit.logs.parse), not the readers
__getattr__, __dir__, __all__ = _exports(__name__, {
    ".parse": ("PP_LOG_FORMAT", "parse_lines"),
    ".files": ("log_files", "parse_files", "parse_run_dir", "rank_from_path"),
    ".messages": ("END", "START", "Event", "decode_action", "decode_message"),
    ".intervals": ("WAITS", "timeline_from_path", "to_timeline", "trim_waits"),
    ".gaps": ("CAUSES", "IdleReport", "explain_idle"),
    ".profiler": ("actions_from_trace", "profile_files", "timeline_from_profile"),
})
