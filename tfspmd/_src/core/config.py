"""tfspmd's global settings, as `jax.config`: `tfspmd.config.update(name, value)`.

`tfspmd_enable_x64` (True by default, TensorFlow's way): with it False,
float64 NumPy inputs arrive as float32, as under JAX's default
(`jax_enable_x64=False`), so that a float64 NumPy batch meets float32
parameters as float32. `tfspmd_log_compiles` (False by default): each trace
and compile logs a line (`compile_log`). JAX's names for them,
`jax_enable_x64` and `jax_log_compiles`, name the same settings, and
`JAX_ENABLE_X64` and `JAX_LOG_COMPILES` in the environment set them at
import, as JAX reads them.
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
LOG_COMPILES_ENV = "JAX_LOG_COMPILES"
EXECUTOR_ENV = "TFSPMD_EXECUTOR"
# What `tfspmd_executor` takes (`executors.selection` says what each runs).
EXECUTORS = ("auto", "host", "dtensor")
# The words JAX takes for a boolean variable of the environment.
_TRUE = ("y", "yes", "t", "true", "on", "1")
_FALSE = ("n", "no", "f", "false", "off", "0")
# JAX's names for tfspmd's settings.
_ALIASES = {"jax_enable_x64": "tfspmd_enable_x64",
            "jax_log_compiles": "tfspmd_log_compiles"}


def _from_environment(variable, setting, default):
  """The environment's `variable` as a bool, `default` when it is unset."""
  value = os.environ.get(variable)
  if value is None:
    return default
  if value.lower() in _TRUE:
    return True
  if value.lower() in _FALSE:
    return False
  raise ValueError(
      f"{variable} must be one of {_TRUE + _FALSE} (any case) to turn "
      f"{setting} on or off, got {value!r}.")


def _executor_from_environment():
  """`TFSPMD_EXECUTOR` as a `tfspmd_executor` value, 'auto' when unset."""
  value = os.environ.get(EXECUTOR_ENV, "auto").strip().lower() or "auto"
  if value not in EXECUTORS:
    raise ValueError(
        f"{EXECUTOR_ENV} must be one of {EXECUTORS} (which executor runs "
        f"tfspmd's programs), got {os.environ[EXECUTOR_ENV]!r}.")
  return value


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
    tfspmd_log_compiles: If True, each trace of a mapped function and each
      program's first run (DTensor's lowering and the compile) logs a line
      on the `tfspmd` logger, with the function, its arguments' dtypes and
      shapes, and the time. Also named `jax_log_compiles`, and set at
      import by `JAX_LOG_COMPILES` as x64 by its variable.
    tfspmd_executor: What runs a compiled program. 'auto' (the default):
      one XLA program on the host for a mesh of CPU devices of one process
      (they share the host's cores; collectives are reductions in memory),
      DTensor's SPMD expansion for accelerators and several processes.
      'host' or 'dtensor' forces one (docs/architecture.md weighs them).
      `TFSPMD_EXECUTOR` in the environment sets it at import. Programs
      are kept per executor: after a change, a call traces (or finds) the
      program of the new one.

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
    self._values = {
        "tfspmd_enable_x64": _from_environment(X64_ENV, "tfspmd_enable_x64",
                                               True),
        "tfspmd_log_compiles": _from_environment(
            LOG_COMPILES_ENV, "tfspmd_log_compiles", False),
        "tfspmd_executor": _executor_from_environment()}

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

  def update(self, name: str, value: bool | str) -> None:
    """Sets the setting `name` to `value`.

    Args:
      name: A setting's name, tfspmd's or JAX's ('jax_enable_x64').
      value: True or False (a NumPy bool too, as JAX takes); for
        `tfspmd_executor`, one of 'auto', 'host', 'dtensor'.

    Raises:
      AttributeError: If there is no setting `name`.
      TypeError: If `value` is not a bool (not a str, for the executor).
      ValueError: If the executor named is not one of them.
    """
    name = _ALIASES.get(name, name)
    if name not in self._values:
      raise AttributeError(
          f"tfspmd.config.update: no setting {name!r}; the settings are "
          f"{sorted(self._values)} (JAX's names: {sorted(_ALIASES)}).")
    if name == "tfspmd_executor":
      self._set_executor(value)
      return
    if not isinstance(value, (bool, np.bool_)):
      raise TypeError(
          f"tfspmd.config.update: {name} must be True or False, got "
          f"{type(value).__name__} {value!r}.")
    with self._lock:
      self._values[name] = bool(value)

  def _set_executor(self, value):
    if not isinstance(value, str):
      raise TypeError(
          f"tfspmd.config.update: tfspmd_executor must be one of "
          f"{EXECUTORS}, got {type(value).__name__} {value!r}.")
    if value not in EXECUTORS:
      raise ValueError(
          f"tfspmd.config.update: tfspmd_executor must be one of "
          f"{EXECUTORS}, got {value!r}.")
    with self._lock:
      self._values["tfspmd_executor"] = value

  def narrowed(self, array: np.ndarray) -> np.ndarray:
    """`array` (a NumPy array) as it arrives on the devices under the settings."""
    if self._values["tfspmd_enable_x64"]:
      return array
    narrower = _NARROWER.get(array.dtype)
    return array if narrower is None else array.astype(narrower)


config = Config()
