"""Layer-wise optimizers whose statistics span the FULL parameter, on plain tensors and on
DTensor parameters with any Shard/Replicate placements.

Each computes on the local blocks (``to_local()``), never through DTensor dispatch, and gets
full-parameter statistics (norms, row/column means, low-rank projections) from local partial
sums all-reduced over exactly the mesh dims the parameter is sharded on, batched: a constant
number of collectives per step, independent of the number of parameters.
"""

from .adafactor import Adafactor
from .came import CAME
from .galore import GaLoreAdamW
from .lamb import Lamb

__all__ = ["Adafactor", "CAME", "GaLoreAdamW", "Lamb"]
