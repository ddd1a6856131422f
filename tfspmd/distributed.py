"""Several processes, one program: `initialize` joins them.

Each process calls `tfspmd.distributed.initialize()` first thing; then a
pmap maps over the devices of all processes, each process passing and
receiving its local part. A process that never joins makes the others'
`initialize` raise `TimeoutError`; one that exits or stops answering later
makes the collectives waiting on it raise `PeerFailedError`
(docs/multiprocess.md). `shutdown()` at the end waits for every process to
get there.
"""

# pylint: disable=useless-import-alias
from tfspmd._src.multiprocess.distributed import PeerFailedError as PeerFailedError
from tfspmd._src.multiprocess.distributed import initialize as initialize
from tfspmd._src.multiprocess.distributed import is_initialized as is_initialized
from tfspmd._src.multiprocess.distributed import shutdown as shutdown

__all__ = [
    "PeerFailedError",
    "initialize",
    "is_initialized",
    "shutdown",
]
