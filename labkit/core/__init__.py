"""The vocabulary every layer shares, importing nothing else of the kit: the timeline data model
(`timeline`: Action, Timeline, bubble metrics), the kit's error (`errors.ConfigError`) and what
both the launcher and a rank need of processes (`processes`), and progress bars (`progress`: jobs,
sweeps and searches show one).

May import: nothing of labkit."""
