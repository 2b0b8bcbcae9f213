"""PP Lab's kit: launch real torch.distributed.pipelining jobs from notebooks and read their timelines."""

__version__ = "0.1.0"
