"""`tf.distribute`'s replica context inside a mapped function.

Code written for `tf.distribute.Strategy.run` asks the strategy how many
replicas compute in sync: `tf.nn.compute_average_loss` divides by that many
per-replica batches, `tf.nn.scale_regularization_loss` by that count. Inside
a pmap (or a shard_map) the replicas are the devices of the axes bound
there, so the function traces in a replica context whose strategy counts
them, and whose `all_reduce` and `all_gather` are `psum`/`pmean` and
`all_gather` over those axes. A vmap's axis is no replica. What a strategy
does beyond that (`merge_call`) has no meaning here and raises; an update
through the strategy (a Keras optimizer's) runs in place, as under the
default strategy.
"""

import contextlib

import tensorflow as tf

from tfspmd._src.collectives import gather
from tfspmd._src.collectives import indexing
from tfspmd._src.collectives import reductions
from tfspmd._src.runtime import axis_env


class _DeviceAxesExtended(tf.distribute.StrategyExtended):
  """The strategy's extended API: the count of replicas, no merge calls."""

  def __init__(self, container_strategy, count):
    super().__init__(container_strategy)
    self._count = count

  @property
  def _num_replicas_in_sync(self):
    return self._count

  def _use_merge_call(self):
    return False

  def _get_local_replica_id(self, replica_id_in_sync_group):
    return replica_id_in_sync_group

  # Variables are the user's, read as they are (the default strategy's).
  def value_container(self, value):
    return value

  def read_var(self, replica_local_var):
    return tf.identity(replica_local_var)

  def _local_results(self, val):
    return (val,)

  def _update(self, var, fn, args, kwargs, group):
    # As the default strategy: the update runs here, on the device's value.
    # A Keras optimizer's `stateless_apply` records it; a write to a real
    # variable is refused as anywhere in a mapped function.
    del group  # unused
    return fn(var, *args, **kwargs)


class _DeviceAxesStrategy(tf.distribute.Strategy):
  """A strategy whose replicas are the devices of the bound axes."""

  def __init__(self, count):
    super().__init__(_DeviceAxesExtended(self, count))


class _DeviceAxesReplicaContext(tf.distribute.ReplicaContext):
  """The replica context of one device: collectives over the bound axes."""

  def __init__(self, strategy, axes):
    super().__init__(strategy, replica_id_in_sync_group=None)
    self._axes = axes

  @property
  def replica_id_in_sync_group(self):
    index = tf.constant(0)
    for name, size in self._axes:
      index = index * size + indexing.axis_index(name)
    return index

  def all_reduce(self, reduce_op, value, options=None):
    del options  # unused
    names = tuple(name for name, _ in self._axes)
    if reduce_op in (tf.distribute.ReduceOp.SUM, "SUM", "sum"):
      return reductions.psum(value, names)
    if reduce_op in (tf.distribute.ReduceOp.MEAN, "MEAN", "mean"):
      return reductions.pmean(value, names)
    raise ValueError(
        f"ReplicaContext.all_reduce inside a mapped function takes "
        f"tf.distribute.ReduceOp.SUM or MEAN, got {reduce_op!r}.")

  def all_gather(self, value, axis, options=None):
    del options  # unused
    names = tuple(name for name, _ in self._axes)
    return tf.nest.map_structure(
        lambda v: gather.all_gather(v, names, axis=axis, tiled=True), value)

  def merge_call(self, merge_fn, args=(), kwargs=None):
    raise _unsupported("`ReplicaContext.merge_call`")


def _unsupported(what):
  return NotImplementedError(
      f"{what} inside a function mapped by tfspmd: the function is the "
      f"program of each device, and tf.distribute's replica context there "
      f"offers `num_replicas_in_sync`, `all_reduce` (psum/pmean over the "
      f"devices' axes) and `all_gather` only. Reduce with tfspmd.lax.psum "
      f"and update variables outside the mapped function.")


@contextlib.contextmanager
def replica_of_device_axes():
  """Traces the body in a replica context of the devices' bound axes.

  Nothing changes where no device axis is bound (a vmap alone).
  """
  axes = tuple((frame.name, frame.size) for frame in axis_env.frames()
               if frame.mesh_dim is not None)
  if not axes:
    yield
    return
  count = 1
  for _, size in axes:
    count *= size
  context = _DeviceAxesReplicaContext(_DeviceAxesStrategy(count), axes)
  # A ReplicaContext enters itself as the replica mode of the graph being
  # traced, as `Strategy.run` enters it.
  with context:
    yield
