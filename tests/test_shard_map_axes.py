"""shard_map where the specs leave mesh axes out, and on 4-D meshes with
size-1 axes, as real meshes are; against NumPy (8 logical CPU devices).

An argument whose spec leaves a mesh axis out is the same on every device
along it; an output whose spec leaves one out must be the same along it.
Gradients are checked against finite differences of the NumPy reference,
or against analytic gradients written out in NumPy.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import P
from tfspmd import lax

from numpy_reference import data, finite_difference
from numpy_reference import over_axes

NAMES = ("data", "fsdp", "tensor", "expert")


def gradient_around(fun, x, cotangent, *others):
  """The gradient of sum(cotangent * fun(x, *others)) by a tape around."""
  x = tf.constant(x)
  with tf.GradientTape() as tape:
    tape.watch(x)
    loss = tf.reduce_sum(tf.convert_to_tensor(fun(x, *others)) * cotangent)
  return tape.gradient(loss, x).numpy()


# --- a NumPy shard_map -------------------------------------------------------


def _block_index(spec, dimension, sizes, coords, names):
  """Which block of `dimension` the device at `coords` holds, of how many."""
  axes = spec[dimension] if dimension < len(spec) else None
  axes = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
  index, count = 0, 1
  for name in axes:
    size = sizes[names.index(name)]
    index, count = index * size + coords[names.index(name)], count * size
  return index, count


def split(x, sizes, spec, names=NAMES):
  """The block of every device: `sizes + block shape`."""
  blocks = None
  for coords in np.ndindex(*sizes):
    index = []
    for dimension, extent in enumerate(x.shape):
      k, count = _block_index(spec, dimension, sizes, coords, names)
      step = extent // count
      index.append(slice(k * step, (k + 1) * step))
    block = x[tuple(index)]
    if blocks is None:
      blocks = np.empty(tuple(sizes) + block.shape, x.dtype)
    blocks[coords] = block
  return blocks


def join(blocks, sizes, spec, names=NAMES):
  """The global array of the devices' blocks; equal blocks must agree."""
  shape = blocks.shape[len(sizes):]
  extents = [n * _block_index(spec, d, sizes, (0,) * len(sizes), names)[1]
             for d, n in enumerate(shape)]
  out = np.full(extents, np.nan)
  for coords in np.ndindex(*sizes):
    index = tuple(
        slice(k * n, (k + 1) * n) for n, (k, _) in zip(shape, (
            _block_index(spec, d, sizes, coords, names)
            for d in range(len(shape)))))
    placed = out[index]
    assert np.isnan(placed).all() or np.allclose(placed, blocks[coords])
    out[index] = blocks[coords]
  return out


# --- every collective over every axis of 4-D meshes ---------------------------


def _ring(size):
  return [(k, (k + 1) % size) for k in range(size)]


def _all_to_all(values, me):
  pieces = [np.split(v, len(values), 0)[me] for v in values]
  return np.concatenate(pieces, 1)


# name: (the collective in tfspmd, its NumPy reference on a group's values)
COLLECTIVES = {
    "psum": (lambda b, a, n: lax.psum(b, a), lambda vs, me: sum(vs)),
    "pmean": (lambda b, a, n: lax.pmean(b, a),
              lambda vs, me: sum(vs) / len(vs)),
    "pmax": (lambda b, a, n: lax.pmax(b, a), lambda vs, me: np.max(vs, 0)),
    "all_gather": (lambda b, a, n: lax.all_gather(b, a, axis=1, tiled=True),
                   lambda vs, me: np.concatenate(vs, 1)),
    "psum_scatter": (
        lambda b, a, n: lax.psum_scatter(b, a, scatter_dimension=1,
                                         tiled=True),
        lambda vs, me: np.split(sum(vs), len(vs), 1)[me]),
    "ppermute": (lambda b, a, n: lax.ppermute(b, a, _ring(n)),
                 lambda vs, me: vs[(me - 1) % len(vs)]),
    "all_to_all": (lambda b, a, n: lax.all_to_all(b, a, 0, 1, tiled=True),
                   _all_to_all),
    "axis_index": (
        lambda b, a, n: b * tf.cast(lax.axis_index(a) + 1, b.dtype), None),
}

# (mesh sizes over NAMES, in spec of an (8, 16) array, out spec). The out
# spec names every axis: most collectives' results vary along their axes.
MESHES = {
    "1x2x4x1": ((1, 2, 4, 1), P(("data", "fsdp"), "tensor"),
                P(("data", "fsdp"), ("tensor", "expert"))),
    "2x1x4x1": ((2, 1, 4, 1), P("data", ("fsdp", "tensor")),
                P(("data", "expert"), ("fsdp", "tensor"))),
    # 'data' (2 devices) left out: every device along it has the whole rows.
    "2x1x4x1 rows replicated": ((2, 1, 4, 1), P(None, "tensor"),
                                P(("data", "fsdp"), ("tensor", "expert"))),
}


def _reference(x, sizes, in_spec, out_spec, collective, axis):
  blocks = split(x, sizes, in_spec)
  if collective == "axis_index":
    position = np.indices(sizes)[NAMES.index(axis)]
    out = blocks * (position + 1).reshape(sizes + (1, 1))
  else:
    out = over_axes(blocks, list(NAMES), [axis], COLLECTIVES[collective][1])
  return join(out, sizes, out_spec)


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("collective", list(COLLECTIVES))
def test_each_collective_over_each_axis_of_a_4d_mesh(mesh_name, collective):
  sizes, in_spec, out_spec = MESHES[mesh_name]
  mesh = tfspmd.make_mesh(sizes, NAMES)
  x = data(8, 16)
  for axis in NAMES:
    size = sizes[NAMES.index(axis)]
    fun = tfspmd.shard_map(
        lambda b, a=axis, n=size: COLLECTIVES[collective][0](b, a, n),
        mesh=mesh, in_specs=in_spec, out_specs=out_spec)
    expected = _reference(x.astype(np.float64), sizes, in_spec, out_spec,
                          collective, axis)
    np.testing.assert_allclose(np.asarray(fun(x)), expected, rtol=1e-5,
                               atol=1e-5, err_msg=axis)


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("collective", list(COLLECTIVES))
def test_gradient_of_each_collective_on_a_4d_mesh_by_a_tape_around(
    mesh_name, collective):
  sizes, in_spec, out_spec = MESHES[mesh_name]
  mesh = tfspmd.make_mesh(sizes, NAMES)
  x = data(8, 16)
  for axis in NAMES:
    size = sizes[NAMES.index(axis)]
    fun = tfspmd.shard_map(
        lambda b, a=axis, n=size: COLLECTIVES[collective][0](b, a, n),
        mesh=mesh, in_specs=in_spec, out_specs=out_spec)
    def loss(v, a=axis):
      return (_reference(v, sizes, in_spec, out_spec, collective, a) *
              cotangent).sum()
    cotangent = data(*_reference(x, sizes, in_spec, out_spec, collective,
                                 axis).shape, seed=1)
    expected = finite_difference(loss, x.astype(np.float64), eps=1e-3)
    np.testing.assert_allclose(gradient_around(fun, x, cotangent), expected,
                               rtol=1e-4, atol=1e-4, err_msg=axis)


@pytest.mark.parametrize("mesh_name", ["1x2x4x1", "2x1x4x1"])
@pytest.mark.parametrize("collective", list(COLLECTIVES))
def test_gradient_of_each_collective_on_a_4d_mesh_by_a_tape_inside(
    mesh_name, collective):
  # Each element of x is on one device, so each device's gradient of its
  # part of the loss is its block of the gradient of the whole loss. The
  # gradient depends on the cotangent, split over every axis: its out spec
  # names them all, which splits it as the in spec does (the axes it adds
  # have size 1).
  sizes, in_spec, out_spec = MESHES[mesh_name]
  mesh = tfspmd.make_mesh(sizes, NAMES)
  x = data(8, 16)
  for axis in NAMES:
    size = sizes[NAMES.index(axis)]

    def local_gradient(b, c, a=axis, n=size):
      with tf.GradientTape() as tape:
        tape.watch(b)
        part = tf.reduce_sum(COLLECTIVES[collective][0](b, a, n) * c)
      return tape.gradient(part, b)

    def loss(v, a=axis):
      return (_reference(v, sizes, in_spec, out_spec, collective, a) *
              cotangent).sum()
    cotangent = data(*_reference(x, sizes, in_spec, out_spec, collective,
                                 axis).shape, seed=1)
    grad = tfspmd.shard_map(local_gradient, mesh=mesh,
                            in_specs=(in_spec, out_spec),
                            out_specs=out_spec)(x, cotangent)
    expected = finite_difference(loss, x.astype(np.float64), eps=1e-3)
    np.testing.assert_allclose(np.asarray(grad), expected, rtol=1e-4,
                               atol=1e-4, err_msg=axis)


# --- specs that leave a mesh axis out ----------------------------------------


@pytest.mark.parametrize("spec", [P("expert"), P(None, "expert")], ids=str)
def test_tape_around_a_shard_map_whose_specs_leave_an_axis_out(spec):
  # The 'data' axis (size 1) is in no spec.
  mesh = tfspmd.make_mesh((1, 4), ("data", "expert"))
  x = data(8, 8)
  loss = tfspmd.shard_map(
      lambda b: lax.psum(tf.reduce_sum(tf.sin(b) * b), "expert"),
      mesh=mesh, in_specs=spec, out_specs=P())
  grad = gradient_around(loss, x, 1.0)
  np.testing.assert_allclose(grad, np.cos(x) * x + np.sin(x), rtol=1e-5,
                             atol=1e-6)


def test_tape_around_with_an_input_and_an_output_replicated_along_an_axis():
  # Every device along 'data' (size 2) has the whole rows of x and of w and
  # computes the same output block, which stands for one value.
  mesh = tfspmd.make_mesh((2, 4), ("data", "expert"))
  x, w = data(8, 8), data(8, 3, seed=1)
  cotangent = data(8, 3, seed=2)
  fun = tfspmd.shard_map(lambda b, v: tf.tanh(b @ v), mesh=mesh,
                         in_specs=(P("expert"), P()), out_specs=P("expert"))
  x_var, w_var = tf.constant(x), tf.constant(w)
  with tf.GradientTape() as tape:
    tape.watch([x_var, w_var])
    out = tf.convert_to_tensor(fun(x_var, w_var))
    loss = tf.reduce_sum(out * cotangent)
  grad_x, grad_w = tape.gradient(loss, [x_var, w_var])
  inner = (1 - np.tanh(x.astype(np.float64) @ w) ** 2) * cotangent
  np.testing.assert_allclose(out, np.tanh(x @ w), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad_x, inner @ w.T, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(grad_w, x.T @ inner, rtol=1e-4, atol=1e-5)


def _loops(b):
  """A while loop, foldl, scan and cond, each around a collective."""
  total = lax.psum(b, "expert")
  _, looped = tf.while_loop(lambda i, acc: i < 3,
                            lambda i, acc: (i + 1, acc + total * 0.5),
                            (0, tf.zeros_like(b)))
  folded = tf.foldl(lambda acc, row: acc + row * lax.pmax(row, "expert"), b,
                    initializer=tf.zeros_like(b[0]))
  scanned = tf.scan(lambda acc, row: acc + lax.psum(row, "expert"), b)
  chosen = tf.cond(tf.reduce_sum(total) > 0, lambda: lax.pmean(b, "expert"),
                   lambda: -b)
  return looped, folded, scanned, chosen


def _loops_reference(x):
  blocks = x.reshape(4, 2, 3)  # the 'expert' blocks of rows
  total = blocks.sum(0)
  looped = np.concatenate([blocks[k] * 0 + 1.5 * total for k in range(4)])
  high = blocks.max(0)
  folded = np.concatenate([(blocks[k] * high).sum(0) for k in range(4)])
  # tf.scan without an initializer starts from the first row as it is.
  scanned = np.concatenate([np.stack([blocks[k][0], blocks[k][0] + total[1]])
                            for k in range(4)])
  chosen = np.concatenate(
      [blocks.mean(0) if total.sum() > 0 else -blocks[k] for k in range(4)])
  return looped, folded, scanned, chosen


def test_loops_and_conditionals_inside_a_shard_map_that_leaves_an_axis_out():
  mesh = tfspmd.make_mesh((1, 4), ("data", "expert"))
  x = data(8, 3)
  outputs = tfspmd.shard_map(
      _loops, mesh=mesh, in_specs=P("expert"),
      out_specs=(P("expert"), P("expert"), P("expert"), P("expert")))(x)
  for out, expected in zip(outputs, _loops_reference(x.astype(np.float64))):
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5,
                               atol=1e-5)


def test_tape_around_loops_inside_a_shard_map_that_leaves_an_axis_out():
  mesh = tfspmd.make_mesh((1, 4), ("data", "expert"))
  x = data(8, 3)
  weights = [data(*shape, seed=k + 1) for k, shape in
             enumerate([(8, 3), (12,), (8, 3), (8, 3)])]

  def weighted(b, *w):
    return lax.psum(sum(tf.reduce_sum(o * v)
                        for o, v in zip(_loops(b), w)), "expert")

  fun = tfspmd.shard_map(weighted, mesh=mesh, in_specs=P("expert"),
                         out_specs=P())

  def loss(v):
    return sum((o * w).sum()
               for o, w in zip(_loops_reference(v), weights))
  expected = finite_difference(loss, x.astype(np.float64), eps=1e-3)
  np.testing.assert_allclose(gradient_around(fun, x, 1.0, *weights),
                             expected, rtol=1e-3, atol=1e-3)


# --- gradients whose shape computations DTensor could not place ---------------


def test_gradient_of_a_batched_matmul_by_a_matrix_by_a_tape_around():
  # (K, B, F) @ (F, F) with B split: the matmul's gradient sums over K.
  mesh = tfspmd.make_mesh((2, 4), ("data", "model"))
  x, w = data(3, 8, 5), data(5, 5, seed=1)
  cotangent = data(3, 8, 5, seed=2)
  fun = tfspmd.shard_map(lambda b, v: b @ v, mesh=mesh,
                         in_specs=(P(None, "data"), P()),
                         out_specs=P(None, "data"))
  x_var, w_var = tf.constant(x), tf.constant(w)
  with tf.GradientTape() as tape:
    tape.watch([x_var, w_var])
    loss = tf.reduce_sum(tf.convert_to_tensor(fun(x_var, w_var)) * cotangent)
  grad_x, grad_w = tape.gradient(loss, [x_var, w_var])
  np.testing.assert_allclose(grad_x, cotangent @ w.T, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(grad_w, np.einsum("kbf,kbg->fg", x, cotangent),
                             rtol=1e-4, atol=1e-5)


def test_gradient_of_roll_inside_a_shard_map_by_a_tape_around_and_inside():
  mesh = tfspmd.make_mesh((2, 4), ("data", "model"))
  x, w = data(3, 8, 5), data(5, 5, seed=1)
  cotangent = data(3, 8, 5, seed=2)
  fun = tfspmd.shard_map(lambda b, v: tf.roll(b @ v, 1, axis=0), mesh=mesh,
                         in_specs=(P(None, "data"), P()),
                         out_specs=P(None, "data"))
  # roll's transpose rolls back.
  expected = np.roll(cotangent, -1, axis=0) @ w.T
  np.testing.assert_allclose(gradient_around(fun, x, cotangent, w), expected,
                             rtol=1e-4, atol=1e-5)

  def local_gradient(b, v, c):
    with tf.GradientTape() as tape:
      tape.watch(b)
      part = tf.reduce_sum(tf.roll(b @ v, 1, axis=0) * c)
    return tape.gradient(part, b)

  inside = tfspmd.shard_map(local_gradient, mesh=mesh,
                            in_specs=(P(None, "data"), P(), P(None, "data")),
                            out_specs=P(None, "data"))
  np.testing.assert_allclose(np.asarray(inside(x, w, cotangent)), expected,
                             rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("axes", [("a", "b"), ("b", "a")])
def test_psum_scatter_over_axes_in_either_order(axes):
  # The block a device gets is numbered by its index along `axes`, the
  # first name major (JAX's linear axis index), whatever the mesh's order.
  x = data(8, 16, seed=3)
  total = x.astype(np.float64).sum(0)

  def block(a, b):
    k = a * 4 + b if axes == ("a", "b") else b * 2 + a
    return total[2 * k:2 * (k + 1)]

  expected = np.array([[block(a, b) for b in range(4)] for a in range(2)])
  mesh = tfspmd.make_mesh((2, 4), ("a", "b"))
  mapped = tfspmd.shard_map(
      lambda v: lax.psum_scatter(v, axes, scatter_dimension=1, tiled=True),
      mesh=mesh, in_specs=P(("a", "b")), out_specs=P(("a", "b"), None))
  np.testing.assert_allclose(np.asarray(mapped(x)), expected.reshape(8, 2),
                             rtol=1e-5)
  nested = tfspmd.pmap(tfspmd.pmap(
      lambda v: lax.psum_scatter(v, axes, scatter_dimension=0, tiled=True),
      "b"), "a")
  np.testing.assert_allclose(np.asarray(nested(x.reshape(2, 4, 16))),
                             expected, rtol=1e-5)
