"""sinkprof: context-parallel attention with attention sinks, and the proof that it is right."""
__version__ = "0.1.0"

from .cpu_math import settle_vector_math
settle_vector_math()   # before any multi-threaded exp/log of this process (sinkprof/cpu_math.py)

from .context_parallel import cp_attention  # noqa: E402
from .plan import pad_pack, shard, unshard  # noqa: E402
from .reference import attention  # noqa: E402
from .schedule import Transfer, comm_bytes  # noqa: E402

__all__ = ["attention", "comm_bytes", "cp_attention", "pad_pack", "shard", "unshard", "Transfer", "__version__"]
