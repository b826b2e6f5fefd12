"""sinkprof: context-parallel attention with attention sinks, and the proof that it is right."""
__version__ = "0.1.0"

from .context_parallel import cp_attention
from .plan import shard, unshard
from .reference import attention

__all__ = ["attention", "cp_attention", "shard", "unshard", "__version__"]
