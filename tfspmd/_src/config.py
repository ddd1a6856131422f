"""tfspmd's global settings, as `jax.config`: `tfspmd.config.update(name, value)`.

One setting so far, `tfspmd_enable_x64` (True by default, TensorFlow's way):
with it False, float64 NumPy inputs arrive as float32, as under JAX's default
(`jax_enable_x64=False`), so that a float64 NumPy batch meets float32
parameters as float32.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

# What NumPy's 64-bit floats become without x64, as in JAX. Integers keep
# their width: JAX's int64 -> int32 would wrap large values without a word.
_NARROWER = {
    np.dtype(np.float64): np.dtype(np.float32),
    np.dtype(np.complex128): np.dtype(np.complex64),
}


class Config:
  """tfspmd's settings; read at every call, changed with `update`.

  Attributes:
    tfspmd_enable_x64: If False, NumPy float64 and complex128 inputs of
      pmap, vmap and shard_map (and operands of `ShardedArray` arithmetic)
      arrive as float32 and complex64, as jax arrays do by default. NumPy
      integers keep their width (JAX's int64 -> int32 would wrap large
      values), and TensorFlow tensors keep their dtype (a tensor's dtype was
      chosen on purpose). Python floats are float32 either way.

  Example:
    >>> import numpy as np, tfspmd
    >>> f = tfspmd.pmap(lambda x: x * 2)
    >>> f(np.ones(2)).dtype
    tf.float64
    >>> tfspmd.config.update('tfspmd_enable_x64', False)
    >>> f(np.ones(2)).dtype
    tf.float32
    >>> tfspmd.config.update('tfspmd_enable_x64', True)
  """

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._values = {"tfspmd_enable_x64": True}

  def __getattr__(self, name: str) -> Any:
    values = self.__dict__.get("_values", {})
    if name in values:
      return values[name]
    raise AttributeError(f"tfspmd.config has no setting {name!r}; it has "
                         f"{sorted(values)}.")

  def update(self, name: str, value: bool) -> None:
    """Sets the setting `name` to `value`.

    Raises:
      AttributeError: If there is no setting `name`.
      TypeError: If `value` is not a bool.
    """
    if name not in self._values:
      raise AttributeError(
          f"tfspmd.config.update: no setting {name!r}; the settings are "
          f"{sorted(self._values)}.")
    if not isinstance(value, bool):
      raise TypeError(
          f"tfspmd.config.update: {name} must be True or False, got "
          f"{type(value).__name__} {value!r}.")
    with self._lock:
      self._values[name] = value

  def narrowed(self, array: np.ndarray) -> np.ndarray:
    """`array` (a NumPy array) as it arrives on the devices under the settings."""
    if self._values["tfspmd_enable_x64"]:
      return array
    narrower = _NARROWER.get(array.dtype)
    return array if narrower is None else array.astype(narrower)


config = Config()
