"""sinkprof: context-parallel attention with attention sinks, and the proof that it is right."""
__version__ = "0.1.0"

from .plan import shard, unshard
from .reference import attention

__all__ = ["attention", "shard", "unshard", "__version__"]
