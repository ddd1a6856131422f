"""JAX's `jax.experimental.multihost_utils`: values exchanged between processes.

>>> import numpy as np
>>> from tfspmd.experimental import multihost_utils
>>> multihost_utils.process_allgather(np.float32(1.5))
array([1.5], dtype=float32)
"""

# pylint: disable=useless-import-alias
from tfspmd._src.multiprocess.host_exchange import broadcast_one_to_all as broadcast_one_to_all
from tfspmd._src.multiprocess.host_exchange import global_array_to_host_local_array as global_array_to_host_local_array
from tfspmd._src.multiprocess.host_exchange import host_local_array_to_global_array as host_local_array_to_global_array
from tfspmd._src.multiprocess.host_exchange import process_allgather as process_allgather
from tfspmd._src.multiprocess.host_exchange import sync_global_devices as sync_global_devices

__all__ = [
    "broadcast_one_to_all",
    "global_array_to_host_local_array",
    "host_local_array_to_global_array",
    "process_allgather",
    "sync_global_devices",
]
