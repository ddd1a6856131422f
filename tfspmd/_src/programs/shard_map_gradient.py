"""Gradients of a shard_map call taken by a GradientTape around it.

The gradient is another shard_map, of the per-device vector-Jacobian
product: each device differentiates `f` on its blocks with a GradientTape
opened inside the innermost mapped function, where every collective carries
its transpose (psum's is psum, all_gather's psum_scatter, ppermute's the
inverse permutation, ...), over whichever mesh axes it names. As in JAX:

* an output whose out spec leaves a mesh axis out is the same on every
  device along it and stands for one value, so each device's cotangent is
  its block of the global cotangent divided by the number of those devices;
* an input whose in spec leaves a mesh axis out is the same on every device
  along it, so its gradient is the psum of the devices' gradients over
  those axes; a variable `f` reads gets the psum over every mesh axis.
"""

import math

import tensorflow as tf

from tfspmd._src.collectives import reductions
from tfspmd._src.core import lru
from tfspmd._src.runtime.named_mesh import PartitionSpec
from tfspmd._src.trees import tree


def _is_differentiable(dtype):
  return dtype.is_floating or dtype.is_complex


def _omitted_axes(spec, mesh):
  """The mesh axes `spec` does not name, in mesh order."""
  named = {name for d in range(len(spec)) for name in spec.axes_of(d)}
  return tuple(name for name in mesh.axis_names if name not in named)


class Gradients:
  """Makes and caches the VJP shard_maps of one shard-mapped function.

  Args:
    make_shard_map: `make_shard_map(fun, in_specs, out_specs)` -> a
      shard-mapped callable on the same mesh.
    fun: The per-device function.
    mesh: The `Mesh`.
  """

  def __init__(self, make_shard_map, fun, mesh):
    self._make_shard_map = make_shard_map
    self._fun = fun
    self._mesh = mesh
    self._vjps = lru.LRUCache(lru.TRACE_CACHE_SIZE)

  def recorded_call(self, run, leaves, treedef, in_specs):
    """Runs `run(leaves)` so that the active GradientTape records it.

    Args:
      run: `run(leaves) -> (output leaves, output treedef, out specs)`, the
        call without a tape; its output leaves are global `ShardedArray`s.
      leaves: The argument leaves as arrays (tensors, NumPy arrays,
        `ShardedArray`s); the tape follows the tensors among them.
      treedef: The arguments' tree.
      in_specs: The in spec of each leaf.

    Returns:
      The global results as `tf.Tensor`s, in the output's tree.
    """
    watched = [k for k, leaf in enumerate(leaves)
               if isinstance(leaf, tf.Tensor) and
               _is_differentiable(leaf.dtype)]
    output = tree.OutputTree()

    @tf.custom_gradient
    def forward(*inputs):
      values = list(leaves)
      for k, tensor in zip(watched, inputs):
        values[k] = tensor
      outputs, output.treedef, out_specs = run(values)
      outputs = [tf.convert_to_tensor(o) for o in outputs]

      def backward(*cotangents, variables=None):
        cotangents = [tf.zeros_like(o) if c is None else c
                      for c, o in zip(cotangents, outputs)]
        vjp = self._vjp(treedef, tuple(in_specs), tuple(watched),
                        tuple(out_specs), tuple(variables or ()))
        input_grads, variable_grads = vjp(values, cotangents)
        input_grads = [tf.convert_to_tensor(g) for g in input_grads]
        variable_grads = [tf.convert_to_tensor(g) for g in variable_grads]
        if variables is None:
          return input_grads
        return input_grads, variable_grads

      return outputs, backward

    outputs = forward(*[leaves[k] for k in watched])
    return output.rebuild(outputs)

  def _vjp(self, treedef, in_specs, watched, out_specs, variables):
    """The VJP shard_map of one call signature, made once."""
    key = (treedef, in_specs, watched, out_specs,
           tuple(id(v) for v in variables))
    vjp = self._vjps.get(key)
    if vjp is None:
      vjp = self._make_vjp(treedef, in_specs, watched, out_specs, variables)
      self._vjps.put(key, vjp)
    return vjp

  def _make_vjp(self, treedef, in_specs, watched, out_specs, variables):
    mesh, fun = self._mesh, self._fun
    scales = [math.prod(mesh.shape[name]
                        for name in _omitted_axes(spec, mesh))
              for spec in out_specs]

    def per_device_vjp(blocks, cotangents):
      sources = [blocks[k] for k in watched]
      with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch(sources)
        tape.watch(variables)
        outputs, _ = tree.flatten(fun(*treedef.unflatten(list(blocks))))
      targets = [tf.convert_to_tensor(o) for o in outputs]
      pairs = [(t, c / tf.cast(scale, c.dtype))
               for t, c, scale in zip(targets, cotangents, scales)
               if _is_differentiable(t.dtype)]
      grads = tape.gradient(
          [t for t, _ in pairs], sources + list(variables),
          output_gradients=[c for _, c in pairs],
          unconnected_gradients=tf.UnconnectedGradients.ZERO)
      input_grads = []
      for k, grad in zip(watched, grads):
        replicated = _omitted_axes(in_specs[k], mesh)
        input_grads.append(reductions.psum(grad, replicated) if replicated
                           else grad)
      variable_grads = [reductions.psum(g, mesh.axis_names)
                        for g in grads[len(sources):]]
      return input_grads, variable_grads

    return self._make_shard_map(
        per_device_vjp,
        in_specs=(list(in_specs), list(out_specs)),
        out_specs=([in_specs[k] for k in watched],
                   [PartitionSpec()] * len(variables)))
