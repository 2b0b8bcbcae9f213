"""A run's measurements read into timelines: torch's pipelining logs (messages, parse: lines -> events;
intervals: events -> Timeline, and how waits are taken out), where idle time went (gaps), and
torch.profiler traces (profiler)."""

from .gaps import CAUSES, IdleReport, explain_idle
from .intervals import WAITS, timeline_from_path, to_timeline, trim_waits
from .messages import END, START, Event, decode_action, decode_message
from .parse import log_files, parse_files, parse_lines, parse_run_dir, rank_from_path
from .profiler import actions_from_trace, profile_files, timeline_from_profile

__all__ = [
    "CAUSES", "END", "IdleReport", "START", "WAITS", "explain_idle", "Event", "actions_from_trace", "decode_action", "decode_message", "log_files",
    "parse_files", "parse_lines", "parse_run_dir", "profile_files", "rank_from_path", "timeline_from_path",
    "timeline_from_profile", "to_timeline", "trim_waits",
]
