"""Gradients of a pmap call taken by a GradientTape around it.

The forward pass is the compiled pmap; its gradient is another pmap, of the
per-device vector-Jacobian product: each device differentiates its own
program with a GradientTape (collectives carry their transposes), arguments
broadcast to every device (in_axes=None) and variables the function reads
get the sum of the devices' gradients, mapped arguments keep one gradient
per device. An output returned once (out_axes=None) stands for the value
every device computed, so each device's part of its cotangent is 1/n of it.
"""

import tensorflow as tf

from tfspmd._src.collectives import reductions
from tfspmd._src.rewrites import side_effects
from tfspmd._src.trees import tree


def is_differentiable(dtype):
  return dtype.is_floating or dtype.is_complex


class VjpProgram:
  """The per-device VJP of one pmap call signature, itself pmapped.

  Args:
    make_pmap: `make_pmap(fun, in_axes, out_axes)` -> a pmapped callable on
      the same devices and axis name as the forward pmap.
    fun: The per-device function.
    rebuild_args: Turns per-device leaves into `(args, kwargs)`.
    leaf_axes: The in axis of each dynamic leaf (None: broadcast).
    out_axes: The out axis of each output leaf (None: one copy).
    variables: The trainable variables the function reads.
    axis_name: The forward pmap's axis name.
  """

  def __init__(self, make_pmap, fun, rebuild_args, leaf_axes, out_axes,
               variables, axis_name):
    self._variables = tuple(variables)
    self._out_axes = list(out_axes)
    self._leaf_axes = list(leaf_axes)

    def per_device_vjp(leaves, cotangents):
      sources = [leaf for leaf in leaves if is_differentiable(leaf.dtype)]
      with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch(sources)
        tape.watch(self._variables)
        args, kwargs = rebuild_args(list(leaves))
        # The forward run printed and checked already.
        with side_effects.ignored():
          outputs, _ = tree.flatten(fun(*args, **kwargs))
      targets = [tf.convert_to_tensor(o) for o in outputs]
      pairs = [(t, c) for t, c in zip(targets, cotangents)
               if is_differentiable(t.dtype)]
      grads = tape.gradient(
          [t for t, _ in pairs], sources + list(self._variables),
          output_gradients=[c for _, c in pairs],
          unconnected_gradients=tf.UnconnectedGradients.ZERO)
      source_grads = iter(grads[:len(sources)])
      leaf_grads = []
      for leaf, axis in zip(leaves, self._leaf_axes):
        if not is_differentiable(leaf.dtype):
          leaf_grads.append(tf.zeros_like(leaf))
          continue
        grad = next(source_grads)
        leaf_grads.append(grad if axis is not None else
                          _sum_over_devices(grad, axis_name))
      variable_grads = [_sum_over_devices(g, axis_name)
                        for g in grads[len(sources):]]
      return leaf_grads, variable_grads

    self._pmapped = make_pmap(
        per_device_vjp, in_axes=(self._leaf_axes, self._out_axes),
        out_axes=(self._leaf_axes, [None] * len(self._variables)))

  @property
  def variables(self):
    return self._variables

  def __call__(self, leaves, cotangents, axis_size):
    scaled = [c if axis is not None else c / tf.cast(axis_size, c.dtype)
              for c, axis in zip(cotangents, self._out_axes)]
    leaf_grads, variable_grads = self._pmapped(list(leaves), scaled)
    return ([tf.convert_to_tensor(g) for g in leaf_grads],
            [tf.convert_to_tensor(g) for g in variable_grads])


def _sum_over_devices(grad, axis_name):
  return reductions.psum(grad, axis_name)


def recorded_call(run, vjp, leaves, axis_size):
  """Runs `run(leaves)` so that the active GradientTape records it.

  Args:
    run: `run(leaves) -> list of output tensors`, the forward pmap call.
    vjp: The `VjpProgram` of this call's signature.
    leaves: The dynamic input leaves, as tensors.
    axis_size: The mapped size, to split cotangents of out_axes=None outputs.

  Returns:
    The outputs as `tf.Tensor`s on the tape.
  """

  @tf.custom_gradient
  def forward(*inputs):
    outputs = run(list(inputs))

    def backward(*cotangents, variables=None):
      cotangents = [tf.zeros_like(o) if c is None else c
                    for c, o in zip(cotangents, outputs)]
      input_grads, variable_grads = vjp(inputs, cotangents, axis_size)
      input_grads = [g if is_differentiable(x.dtype) else None
                     for g, x in zip(input_grads, inputs)]
      if variables is None:
        return input_grads
      by_variable = {id(v): g for v, g in zip(vjp.variables, variable_grads)}
      return input_grads, [by_variable.get(id(v)) for v in variables]

    return outputs, backward

  return forward(*leaves)
