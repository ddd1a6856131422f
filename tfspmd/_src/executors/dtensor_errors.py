"""DTensor's refusals of an op in a pmap's program, as errors that say what to do.

DTensor turns the traced program into each device's program on its first
run, and reports an op it cannot place as an MLIR diagnostic inside a
`tf.errors.UnknownError` ("loc: error: 'tf.MatrixInverse' op does not
implement layout propagation ..."). `explain` names the op in the user's
terms and says what to change.
"""

import re

import tensorflow as tf

from tfspmd._src.core import tf_internal
from tfspmd._src.executors import dtensor_calls

_DIAGNOSTIC = re.compile(r"error: 'tf\.(\w+)' op ([^\n\[]*)")

_NO_LAYOUT = "does not implement layout propagation"

_FAILED_OPERATION = re.compile(r'see current operation: %\S+ = "tf\.(\w+)"')

# Ops users meet through another API, and what to write instead.
_HINTS = {
    "DynamicPartition": (
        "pfor makes it from a tf.cond or tf.while_loop whose condition "
        "differs between devices; compute both branches and pick with "
        "tf.where instead"),
    "DynamicStitch": (
        "pfor makes it from a tf.cond or tf.while_loop whose condition "
        "differs between devices; compute both branches and pick with "
        "tf.where instead"),
    "TensorListStack": (
        "a tf.TensorArray makes it; collect the values in a Python list and "
        "tf.stack them"),
}


def _expansion_failure(error, axis_name):
  """A ValueError for DTensor's failure to expand one op, or None.

  DTensor reports it as "error: <why>" followed by its stack and "see
  current operation: %N = "tf.<Op>"(...)".
  """
  found = _FAILED_OPERATION.search(error.message)
  if found is None or "While computing SPMD expansion" not in error.message:
    return None
  why = error.message.split("error: ", 1)[-1]
  why = why.split(". The full requested layout")[0].split("\n")[0]
  why = re.sub(r" sharding_specs:\S*( mesh:\S*)?", "", why).strip().rstrip(".")
  return ValueError(
      f"the function mapped over axis {axis_name!r} uses the op "
      f"{found.group(1)}, which DTensor (TF {tf.__version__}) could not split "
      f"over the devices: {why}. Build the op's inputs another way (a "
      f"tf.where or a one-hot sum), or compute the op outside the mapped "
      f"function.")


def _names_taken(error, axis_name):
  """A RuntimeError for DTensor's names taken at every try (`flat_caller`)."""
  name = re.search(r"Cannot add function '([^']*)'", error.message).group(1)
  return RuntimeError(
      f"DTensor (TF {tf.__version__}) could not lower the function mapped "
      f"over axis {axis_name!r}: {dtensor_calls.RELOWERINGS + 1} times in a "
      f"row, a name it gave a function it made of the program's loops or "
      f"branches (last {name!r}) was already taken by an earlier program's "
      f"function. Nothing ran and arrays computed before stay valid; calling "
      f"it again lowers it under new names.")


def explain(error, axis_name):
  """A ValueError for `error` naming the op DTensor refused, or None.

  Args:
    error: A `tf.errors.OpError` raised by the first run of a program.
    axis_name: The pmap's axis name, for the message.
  """
  if dtensor_calls.name_taken(error):
    return _names_taken(error, axis_name)
  match = _DIAGNOSTIC.search(error.message)
  if match is None:
    return _expansion_failure(error, axis_name)
  op = match.group(1)
  # "ComputeLayoutForward error: <what>. Please file a feature request ..."
  reason = match.group(2).split(" Please ")[0].strip().rstrip(".")
  reason = reason.split("error: ")[-1]
  what = (f"the function mapped over axis {axis_name!r} uses the op {op}, "
          f"which DTensor (TF {tf.__version__}) cannot place on the mesh: "
          f"{reason}.")
  if "Stateful random operations" in reason:
    return ValueError(
        f"{what} Use the stateless random ops (tf.random.stateless_uniform, "
        f"...) with a seed passed as an argument; for a different stream on "
        f"each device, fold in lax.axis_index (tf.random.experimental."
        f"stateless_fold_in).")
  if "ui64" in reason:
    return ValueError(
        f"{what} DTensor's collectives move no uint64 between devices: cast "
        f"the value to int64 around the op that moves it (tf.cast keeps the "
        f"bits, and sums wrap the same).")
  todo = _HINTS.get(op, "compute it outside the mapped function, or with "
                        "other ops")
  if _NO_LAYOUT in reason:
    todo += (f"; or set the environment variable "
             f"DTENSOR_ENABLE_REPLICATED_SPMD_AS_DEFAULT_TF.{op.upper()}=1 "
             f"before the first call, and every device computes the op for "
             f"all devices (right, but not split)")
  return ValueError(f"{what} To fix: {todo}.")
