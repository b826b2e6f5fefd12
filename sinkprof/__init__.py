"""sinkprof: context-parallel attention with attention sinks, and the proof that it is right."""
__version__ = "0.1.0"

from .context_parallel import cp_attention
from .plan import pad_pack, shard, unshard
from .reference import attention
from .schedule import Transfer, comm_bytes

__all__ = ["attention", "comm_bytes", "cp_attention", "pad_pack", "shard", "unshard", "Transfer", "__version__"]
