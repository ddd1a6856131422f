"""tfspmd's global settings, as `jax.config`: `tfspmd.config.update(name, value)`.

One setting so far, `tfspmd_enable_x64` (True by default, TensorFlow's way):
with it False, float64 NumPy inputs arrive as float32, as under JAX's default
(`jax_enable_x64=False`), so that a float64 NumPy batch meets float32
parameters as float32. JAX's name for it, `jax_enable_x64`, names the same
setting, and `JAX_ENABLE_X64` in the environment sets it at import, as JAX
reads it.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

# What NumPy's 64-bit floats become without x64, as in JAX. Integers keep
# their width: JAX's int64 -> int32 would wrap large values without a word.
_NARROWER = {
    np.dtype(np.float64): np.dtype(np.float32),
    np.dtype(np.complex128): np.dtype(np.complex64),
}


X64_ENV = "JAX_ENABLE_X64"
# The words JAX takes for a boolean variable of the environment.
_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")
# JAX's names for tfspmd's settings.
_ALIASES = {"jax_enable_x64": "tfspmd_enable_x64"}


def _x64_from_environment():
  """`JAX_ENABLE_X64` as a bool, True (TensorFlow's way) when it is unset."""
  value = os.environ.get(X64_ENV)
  if value is None:
    return True
  if value.lower() in _TRUE:
    return True
  if value.lower() in _FALSE:
    return False
  raise ValueError(
      f"{X64_ENV} must be one of {_TRUE + _FALSE} (any case) to turn "
      f"tfspmd_enable_x64 on or off, got {value!r}.")


class Config:
  """tfspmd's settings; read at every call, changed with `update`.

  Attributes:
    tfspmd_enable_x64: If False, NumPy float64 and complex128 inputs of
      pmap, vmap and shard_map (and operands of `ShardedArray` arithmetic)
      arrive as float32 and complex64, as jax arrays do by default. NumPy
      integers keep their width (JAX's int64 -> int32 would wrap large
      values), and TensorFlow tensors keep their dtype (a tensor's dtype was
      chosen on purpose). Python floats are float32 either way. Also named
      `jax_enable_x64`; `JAX_ENABLE_X64=0` (or `false`, `no`, `off`) in the
      environment turns it off at import, `1` (`true`, `yes`, `on`) on.

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
    self._values = {"tfspmd_enable_x64": _x64_from_environment()}

  def __getattr__(self, name: str) -> Any:
    values = self.__dict__.get("_values", {})
    name = _ALIASES.get(name, name)
    if name in values:
      return values[name]
    raise AttributeError(f"tfspmd.config has no setting {name!r}; it has "
                         f"{sorted(values)}.")

  def __setattr__(self, name: str, value: Any) -> None:
    # As jax.config, whose settings are read-only properties: a setting
    # changes through `update` only, which checks the value.
    if name.startswith("_"):
      object.__setattr__(self, name, value)
      return
    setting = _ALIASES.get(name, name)
    if setting in self._values:
      raise AttributeError(
          f"tfspmd.config.{name} cannot be assigned; write "
          f"tfspmd.config.update({name!r}, {value!r}) instead.")
    raise AttributeError(
        f"tfspmd.config has no setting {name!r} to assign; the settings are "
        f"{sorted(self._values)}, changed with tfspmd.config.update(name, "
        f"value).")

  def update(self, name: str, value: bool) -> None:
    """Sets the setting `name` to `value`.

    Args:
      name: A setting's name, tfspmd's or JAX's ('jax_enable_x64').
      value: True or False (a NumPy bool too, as JAX takes).

    Raises:
      AttributeError: If there is no setting `name`.
      TypeError: If `value` is not a bool.
    """
    name = _ALIASES.get(name, name)
    if name not in self._values:
      raise AttributeError(
          f"tfspmd.config.update: no setting {name!r}; the settings are "
          f"{sorted(self._values)} (JAX's names: {sorted(_ALIASES)}).")
    if not isinstance(value, (bool, np.bool_)):
      raise TypeError(
          f"tfspmd.config.update: {name} must be True or False, got "
          f"{type(value).__name__} {value!r}.")
    with self._lock:
      self._values[name] = bool(value)

  def narrowed(self, array: np.ndarray) -> np.ndarray:
    """`array` (a NumPy array) as it arrives on the devices under the settings."""
    if self._values["tfspmd_enable_x64"]:
      return array
    narrower = _NARROWER.get(array.dtype)
    return array if narrower is None else array.astype(narrower)


config = Config()
