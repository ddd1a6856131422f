"""Inputs of expanded programs, given as the programs' own outputs are.

Under DTensor's multi-device expansion (`dtensor_settings`; TF 2.21, CPU
devices) a program's outputs report the host's first CPU device for every
component, while an array packed from the host reports the device each
component lies on. TensorFlow's eager runtime keys the compiled
multi-device function on the devices its inputs report, so a program first
called with arrays placed from the host and then with its own outputs (a
training loop's state) instantiated and compiled its function twice: the
second step of a convolutional training loop took 0.18 s against 0.009 s
for the steps after it, a ResNet's 5 s.

So every input of such a program reports what an output reports: an input
placed from the host goes first through an identity function run under the
expansion (no data copied; an eager op would not do, as DTensor runs one on
replicated inputs device by device), and a `ShardedArray` keeps that form
for its later calls. The function takes a group of a call's inputs at once
(about 0.1 ms; DTensor lowers it once per group's shapes, 10-20 ms): inputs
grouped by what the caller knows of where they come from, so that the group
placed from the host at every call (a training loop's batches) is one the
first call lowered already.
"""

import collections

import tensorflow as tf

from tfspmd._src.core import lru
from tfspmd._src.core import tf_internal
from tfspmd._src.executors import dtensor_calls
from tfspmd._src.executors import dtensor_device
from tfspmd._src.executors import dtensor_settings

_EXPANSION = (dtensor_settings.MULTI_DEVICE_EXPANSION,)
# The identity functions, by their inputs' (shape, dtype)s.
_identities = lru.LRUCache(lru.TRACE_CACHE_SIZE)


def as_outputs(values, groups):
  """`values` (DTensors) reporting their devices as an expanded program's outputs.

  Args:
    values: The DTensors of a call's inputs.
    groups: For each, None if it already is an expanded program's output,
      else the key of the group it goes through the identity function with.

  Returns:
    The list of DTensors: those of group None as given, the others through
    one identity function per group, run under the expansion.
  """
  members = collections.defaultdict(list)
  for index, group in enumerate(groups):
    if group is not None:
      members[group].append(index)
  relabelled = list(values)
  with dtensor_settings.applied(_EXPANSION), dtensor_device.entry:
    for indices in members.values():
      inputs = [values[i] for i in indices]
      outputs = _identity(inputs)(*inputs)
      for index, output in zip(indices, outputs):
        relabelled[index] = output
  return relabelled


def _identity(values):
  """A fast caller of an identity function of `values`' shapes and dtypes.

  One `tf.function` per signature, traced once: a function retraced for
  ever-new signatures would warn of retracing.
  """
  key = tuple((tuple(value.shape), value.dtype) for value in values)
  caller = _identities.get(key)
  if caller is None:
    function = tf.function(lambda *tensors: [tf.identity(t) for t in tensors],
                           autograph=False)
    caller = dtensor_calls.flat_caller(function.get_concrete_function(
        *[tf.TensorSpec(shape, dtype) for shape, dtype in key]), [])
    _identities.put(key, caller)
  return caller
