"""Layer-wise optimizers whose statistics span the FULL parameter, on plain tensors and on
DTensor parameters with any Shard/Replicate placements.

Each computes on the local blocks (``to_local()``), never through DTensor dispatch, and gets
full-parameter statistics (norms, row/column means, low-rank projections) from local partial
sums all-reduced over exactly the mesh dims the parameter is sharded on, batched: a constant
number of collectives per step, independent of the number of parameters.

The state of a DTensor parameter is DTensors on its mesh (``_dist.state_like``): global shape
what the state means for the full parameter, placements that make the local block exactly what
the rank computes on -- so ``torch.distributed.checkpoint`` saves and reshards it like the
state of torch's own optimizers. Plain parameters keep plain state; ``step`` stays plain.
"""

from .adafactor import Adafactor
from .came import CAME
from .galore import GaLoreAdamW
from .lamb import Lamb

__all__ = ["Adafactor", "CAME", "GaLoreAdamW", "Lamb"]
