"""Every collective against a NumPy reference, on 2, 4 and 8 devices.

The reference runs the per-device semantics slice by slice: device i's
input is `x[i]`, and each collective's result on device i is written out
with NumPy below.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax

import numpy_reference

SIZES = [2, 4, 8]


def data(n, *shape, dtype=np.float32, seed=0):
  return np.random.default_rng(seed + n).standard_normal((n,) + shape).astype(dtype)


def run(function, x, **kwargs):
  return np.asarray(tfspmd.pmap(function, axis_name="i", **kwargs)(x))


@pytest.mark.parametrize("n", SIZES)
def test_psum_pmean_pmax_pmin(n):
  x = data(n, 3)
  np.testing.assert_allclose(run(lambda v: lax.psum(v, "i"), x),
                             np.broadcast_to(x.sum(0), x.shape), rtol=1e-5)
  np.testing.assert_allclose(run(lambda v: lax.pmean(v, "i"), x),
                             np.broadcast_to(x.mean(0), x.shape), rtol=1e-5)
  np.testing.assert_array_equal(run(lambda v: lax.pmax(v, "i"), x),
                                np.broadcast_to(x.max(0), x.shape))
  np.testing.assert_array_equal(run(lambda v: lax.pmin(v, "i"), x),
                                np.broadcast_to(x.min(0), x.shape))


@pytest.mark.parametrize("n", SIZES)
def test_pmean_of_integers_is_float(n):
  x = np.arange(n, dtype=np.int32)
  np.testing.assert_allclose(run(lambda v: lax.pmean(v, "i"), x),
                             np.full(n, x.mean()))


def test_collectives_of_pytrees():
  x = {"a": data(4, 2), "b": (data(4, 3, seed=1),)}
  out = tfspmd.pmap(lambda t: lax.psum(t, "i"), "i")(x)
  np.testing.assert_allclose(out["a"], np.broadcast_to(x["a"].sum(0), (4, 2)), rtol=1e-5)
  np.testing.assert_allclose(out["b"][0], np.broadcast_to(x["b"][0].sum(0), (4, 3)),
                             rtol=1e-5)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("axis", [0, 1, 2, -1])
def test_all_gather(n, axis):
  x = data(n, 2, 3)
  expected_one = np.moveaxis(x, 0, axis % 3)
  out = run(lambda v: lax.all_gather(v, "i", axis=axis), x)
  np.testing.assert_array_equal(out, np.broadcast_to(expected_one, (n,) + expected_one.shape))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_all_gather_tiled(n, axis):
  x = data(n, 2, 3)
  expected_one = np.concatenate(list(x), axis=axis)
  out = run(lambda v: lax.all_gather(v, "i", axis=axis, tiled=True), x)
  np.testing.assert_array_equal(out, np.broadcast_to(expected_one, (n,) + expected_one.shape))


def test_all_gather_of_a_broadcast_value():
  out = tfspmd.pmap(lambda v, w: lax.all_gather(w, "i") + v, "i",
                    in_axes=(0, None))(np.zeros(4, np.float32), np.float32(3.))
  np.testing.assert_array_equal(out, np.full((4, 4), 3.))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dimension", [0, 1, -1])
def test_psum_scatter(n, dimension):
  shape = [3, 3]
  shape[dimension] = n
  x = data(n, *shape)
  total = x.sum(0)
  expected = np.stack([np.take(total, i, axis=dimension) for i in range(n)])
  out = run(lambda v: lax.psum_scatter(v, "i", scatter_dimension=dimension), x)
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dimension", [0, 1])
def test_psum_scatter_tiled(n, dimension):
  shape = [3, 3]
  shape[dimension] = 2 * n
  x = data(n, *shape)
  blocks = np.split(x.sum(0), n, axis=dimension)
  out = run(lambda v: lax.psum_scatter(v, "i", scatter_dimension=dimension,
                                       tiled=True), x)
  np.testing.assert_allclose(out, np.stack(blocks), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", SIZES)
def test_psum_scatter_of_a_value_split_along_its_last_axis(n):
  # The all_gather leaves w split along its rows, so DTensor lays out the
  # product split along its last axis; psum_scatter then moves the split of
  # a rank-4 value from axis 3 to axis 1, which DTensor's all-to-all
  # scrambled (the weight gradients of the shard_map tutorial's FSDP MLP).
  x = data(n, 8, 8)
  w = data(n, 2, 8, seed=1)

  def f(v, u):
    gathered = lax.all_gather(u, "i", tiled=True)
    product = tf.transpose(v @ tf.ones([8, 8])) @ tf.transpose(gathered)
    return lax.psum_scatter(product, "i", tiled=True)

  products = [(x[i] @ np.ones((8, 8))).T @ w.reshape(2 * n, 8).T
              for i in range(n)]
  expected = np.stack(np.split(np.sum(products, 0), n))
  out = np.asarray(tfspmd.pmap(f, axis_name="i")(x, w))
  np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def reference_ppermute(x, perm):
  out = np.zeros_like(x)
  for source, destination in perm:
    out[destination] = x[source]
  return out


@pytest.mark.parametrize("n", SIZES)
def test_ppermute_ring_and_partial(n):
  x = data(n, 2)
  ring = [(i, (i + 1) % n) for i in range(n)]
  np.testing.assert_array_equal(run(lambda v: lax.ppermute(v, "i", ring), x),
                                reference_ppermute(x, ring))
  partial = [(0, n - 1), (n - 1, 0)] if n > 2 else [(0, 1)]
  np.testing.assert_array_equal(run(lambda v: lax.ppermute(v, "i", partial), x),
                                reference_ppermute(x, partial))


@pytest.mark.parametrize("n", SIZES)
def test_pshuffle(n):
  x = data(n, 3)
  perm = list(np.random.default_rng(n).permutation(n))
  np.testing.assert_array_equal(run(lambda v: lax.pshuffle(v, "i", perm), x),
                                x[perm])


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("split_axis, concat_axis", [(0, 0), (0, 1), (1, 0), (1, 1), (-1, 0)])
def test_all_to_all(n, split_axis, concat_axis):
  shape = [3, 3]
  shape[split_axis] = n
  x = data(n, *shape)
  split = split_axis % 2
  expected = []
  for i in range(n):
    pieces = [np.take(x[j], i, axis=split) for j in range(n)]
    expected.append(np.stack(pieces, axis=concat_axis))
  out = run(lambda v: lax.all_to_all(v, "i", split_axis, concat_axis), x)
  np.testing.assert_array_equal(out, np.stack(expected))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("split_axis, concat_axis", [(0, 0), (0, 1), (1, 0)])
def test_all_to_all_tiled(n, split_axis, concat_axis):
  shape = [2, 2]
  shape[split_axis] = 2 * n
  x = data(n, *shape)
  expected = []
  for i in range(n):
    pieces = [np.split(x[j], n, axis=split_axis)[i] for j in range(n)]
    expected.append(np.concatenate(pieces, axis=concat_axis))
  out = run(lambda v: lax.all_to_all(v, "i", split_axis, concat_axis, tiled=True), x)
  np.testing.assert_array_equal(out, np.stack(expected))


@pytest.mark.parametrize("n", SIZES)
def test_pswapaxes(n):
  x = data(n, n, 3)
  out = run(lambda v: lax.pswapaxes(v, "i", 0), x)
  np.testing.assert_array_equal(out, np.swapaxes(x, 0, 1))


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("collective", ["ppermute", "psum_scatter",
                                        "all_to_all"])
def test_collective_of_a_row_written_into_new_zeros(n, collective):
  # The collective's input is made on the device (zeros, one row set from
  # the argument), so nothing but the collective decides its layout.
  functions = {
      "ppermute": lambda v: lax.ppermute(
          v, "i", [(i, (i + 1) % n) for i in range(n)]),
      "psum_scatter": lambda v: lax.psum_scatter(v, "i", tiled=True),
      "all_to_all": lambda v: lax.all_to_all(v, "i", 0, 1, tiled=True),
  }
  x = data(n, 4)

  def f(v):
    return functions[collective](
        tf.tensor_scatter_nd_update(tf.zeros((n, 4)), [[0]], v[None]))

  rows = np.zeros((n, n, 4), np.float32)
  rows[:, 0] = x
  want = {
      "ppermute": np.roll(rows, 1, axis=0),
      "psum_scatter": rows.sum(0)[:, None],
      "all_to_all": np.stack([rows[:, k].reshape(1, -1) for k in range(n)]),
  }[collective]
  np.testing.assert_allclose(run(f, x), want, rtol=1e-6)


@pytest.mark.parametrize("n", SIZES)
def test_a_row_of_an_all_gather_picked_at_a_constant_and_a_per_device_index(
    n):
  # The last device's row, the device's own, and its ring neighbour's.
  x = data(n, 3)

  def rows(v):
    gathered = lax.all_gather(v, "i")
    neighbour = (lax.axis_index("i") + 1) % n
    return gathered[n - 1], gathered[lax.axis_index("i")], tf.gather(
        gathered, neighbour)

  last, own, neighbour = (np.asarray(r) for r in
                          tfspmd.pmap(rows, "i")(x))
  np.testing.assert_array_equal(last, np.broadcast_to(x[n - 1], x.shape))
  np.testing.assert_array_equal(own, x)
  np.testing.assert_array_equal(neighbour, np.roll(x, -1, axis=0))


@pytest.mark.parametrize("n", SIZES)
def test_axis_index_and_size(n):
  out = tfspmd.pmap(lambda v: (lax.axis_index("i"), lax.axis_size("i") + 0 * lax.axis_index("i")),
                    "i")(np.zeros(n))
  np.testing.assert_array_equal(out[0], np.arange(n))
  np.testing.assert_array_equal(out[1], np.full(n, n))


def test_collectives_over_outer_inner_and_both_axes_on_a_2d_mesh():
  x = data(8, 3).reshape(2, 4, 3)

  def f(v):
    return (lax.pmax(v, "r"), lax.pmin(v, ("r", "c")), lax.pmean(v, "c"),
            lax.all_gather(v, "c"), lax.ppermute(v, "r", [(0, 1), (1, 0)]),
            lax.all_gather(v, "r"))

  inner = tfspmd.pmap(f, axis_name="c")
  out = [np.asarray(o) for o in tfspmd.pmap(inner, axis_name="r")(x)]
  np.testing.assert_array_equal(out[0], np.broadcast_to(x.max(0), x.shape))
  np.testing.assert_array_equal(out[1], np.broadcast_to(x.min((0, 1)), x.shape))
  np.testing.assert_allclose(out[2], np.broadcast_to(x.mean(1, keepdims=True), x.shape), rtol=1e-5)
  np.testing.assert_array_equal(out[3], np.broadcast_to(x[:, None], (2, 4, 4, 3)))
  np.testing.assert_array_equal(out[4], x[::-1])
  np.testing.assert_array_equal(
      out[5], np.broadcast_to(np.moveaxis(x, 0, 1)[:, None], (4, 2, 2, 3)).transpose(1, 0, 2, 3))


def test_argsort_after_all_to_all_over_one_axis_of_a_2d_mesh():
  # TopKV2 (argsort) expands wrong on a value whose layout DTensor is left
  # to pick: the all_to_all's result is pinned to each device's blocks.
  mesh = tfspmd.Mesh(np.array(tfspmd.devices()).reshape(2, 4), ("x", "y"))
  f = tfspmd.shard_map(
      lambda v: tf.argsort(lax.all_to_all(v, "y", 0, 0, tiled=True)),
      mesh=mesh, in_specs=(tfspmd.P(("x", "y")),),
      out_specs=tfspmd.P(("x", "y")))
  x = np.random.default_rng(0).permutation(64).astype(np.float32)
  blocks = x.reshape(2, 4, 4, 2)  # x, y, block for each y, block
  received = blocks.transpose(0, 2, 1, 3).reshape(2, 4, 8)
  np.testing.assert_array_equal(np.asarray(f(x)),
                                np.argsort(received, axis=-1).reshape(-1))


def test_collectives_on_a_3d_mesh():
  x = data(8, 2).reshape(2, 2, 2, 2)

  def f(v):
    return (lax.psum(v, ("a", "c")), lax.all_to_all(v, "b", 0, 0),
            lax.psum_scatter(v, "c"))

  g = tfspmd.pmap(tfspmd.pmap(tfspmd.pmap(f, axis_name="c"), axis_name="b"),
                  axis_name="a")
  summed, exchanged, scattered = [np.asarray(o) for o in g(x)]
  np.testing.assert_allclose(summed, np.broadcast_to(x.sum((0, 2), keepdims=True), x.shape),
                             rtol=1e-5)
  # all_to_all over 'b' of per-device vectors of length 2: out[a,i,c][j] = x[a,j,c][i].
  np.testing.assert_array_equal(exchanged, np.swapaxes(x, 1, 3))
  # psum_scatter over 'c': out[a,b,i] = sum_j x[a,b,j][i].
  np.testing.assert_allclose(scattered, np.swapaxes(x.sum(2), 1, 2).swapaxes(1, 2), rtol=1e-5)


# Collectives over tuples of axes act on the linear index over the named
# axes, the first name major. The reference below builds, for each device,
# its group (the devices that differ only along the named axes) in that
# order and applies the per-device semantics with NumPy.


def gather_ref(axis, tiled):
  return lambda values, me: (np.concatenate(values, axis) if tiled
                             else np.stack(values, axis))


def scatter_ref(dimension, tiled):
  def per_device(values, me):
    total = np.sum(values, axis=0)
    if tiled:
      return np.split(total, len(values), axis=dimension)[me]
    return np.take(total, me, axis=dimension)
  return per_device


def permute_ref(pairs):
  source_of = {d: s for s, d in pairs}
  return lambda values, me: (values[source_of[me]] if me in source_of
                             else np.zeros_like(values[0]))


def all_to_all_ref(split_axis, concat_axis, tiled):
  def per_device(values, me):
    n = len(values)
    if tiled:
      parts = [np.split(v, n, axis=split_axis)[me] for v in values]
      return np.concatenate(parts, axis=concat_axis)
    parts = [np.take(v, me, axis=split_axis) for v in values]
    return np.stack(parts, axis=concat_axis)
  return per_device


def nested_pmap(function, mesh_names):
  for name in reversed(mesh_names):
    function = tfspmd.pmap(function, axis_name=name)
  return function


TUPLE_CASES = [
    (("r", "c"), (2, 4), ("r", "c")),
    (("r", "c"), (2, 4), ("c", "r")),
    (("a", "b", "c"), (2, 2, 2), ("a", "c")),
    (("a", "b", "c"), (2, 2, 2), ("c", "a")),
    (("a", "b", "c"), (2, 2, 2), ("b", "c")),
    (("a", "b", "c"), (2, 2, 2), ("c", "b", "a")),
    # One axis of a nested mesh, named alone.
    (("r", "c"), (2, 4), ("r",)),
    (("r", "c"), (2, 4), ("c",)),
    (("a", "b", "c"), (2, 2, 2), ("b",)),
]


def tuple_case_id(case):
  return "".join(case[0]) + "-over-" + "".join(case[2])


@pytest.mark.parametrize("case", TUPLE_CASES, ids=tuple_case_id)
def test_collectives_over_tuples_of_axes(case):
  mesh_names, mesh_shape, names = case
  axis_name = names[0] if len(names) == 1 else names
  n = int(np.prod([mesh_shape[mesh_names.index(a)] for a in names]))
  x = np.random.default_rng(7).standard_normal(
      mesh_shape + (n, 2)).astype(np.float32)
  ring = [(k, (k + 1) % n) for k in range(n)]
  partial = [(0, n - 1), (n - 1, 1)] if n > 2 else [(0, 1)]
  shuffle = [(k * 3 + 1) % n for k in range(n)] if n % 3 else list(
      reversed(range(n)))
  cases = {
      "all_gather": (lambda v: lax.all_gather(v, axis_name, axis=1),
                     gather_ref(1, False)),
      "all_gather_tiled": (lambda v: lax.all_gather(v, axis_name, axis=-1,
                                                    tiled=True),
                           gather_ref(-1, True)),
      "psum_scatter": (lambda v: lax.psum_scatter(v, axis_name),
                       scatter_ref(0, False)),
      "psum_scatter_tiled": (lambda v: lax.psum_scatter(
          v, names, scatter_dimension=0, tiled=True), scatter_ref(0, True)),
      "ppermute_ring": (lambda v: lax.ppermute(v, axis_name, ring),
                        permute_ref(ring)),
      "ppermute_partial": (lambda v: lax.ppermute(v, axis_name, partial),
                           permute_ref(partial)),
      "pshuffle": (lambda v: lax.pshuffle(v, axis_name, shuffle),
                   permute_ref([(s, d) for d, s in enumerate(shuffle)])),
      "all_to_all": (lambda v: lax.all_to_all(v, axis_name, 0, 1),
                     all_to_all_ref(0, 1, False)),
      "all_to_all_tiled": (lambda v: lax.all_to_all(v, axis_name, 0, 1,
                                                     tiled=True),
                           all_to_all_ref(0, 1, True)),
      "pswapaxes": (lambda v: lax.pswapaxes(v, axis_name, 0),
                    all_to_all_ref(0, 0, False)),
      "axis_index": (lambda v: lax.axis_index(axis_name),
                     lambda values, me: np.int32(me)),
  }
  functions = {key: f for key, (f, _) in cases.items()}
  out = nested_pmap(lambda v: {k: f(v) for k, f in functions.items()},
                    mesh_names)(x)
  for key, (_, per_device) in cases.items():
    expected = numpy_reference.over_axes(x, mesh_names, names, per_device)
    np.testing.assert_allclose(np.asarray(out[key]), expected, rtol=1e-5,
                               atol=1e-6, err_msg=key)


def test_tuple_collective_of_a_value_invariant_along_an_inner_axis():
  x = data(2, 4)
  inner = tfspmd.pmap(lambda v, w: lax.all_gather(v, ("r", "c")) + w, "c",
                      in_axes=(None, 0))
  out = tfspmd.pmap(inner, "r", in_axes=(0, None))(x, np.zeros(3, np.float32))
  assert out.shape == (2, 3, 6, 4)
  np.testing.assert_array_equal(
      np.asarray(out), np.broadcast_to(np.repeat(x, 3, axis=0), (2, 3, 6, 4)))


def test_all_to_all_over_an_inner_axis_with_blocks_of_two():
  # DTensor's own all-to-all relayout scrambles this case (test_known_defects).
  x = np.arange(2 * 4 * 4 * 2, dtype=np.float32).reshape(2, 4, 4, 2)
  inner = tfspmd.pmap(lambda v: lax.all_to_all(v, "c", 0, 0), axis_name="c")
  out = tfspmd.pmap(inner, axis_name="r")(x)
  np.testing.assert_array_equal(np.asarray(out), np.swapaxes(x, 1, 2))


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.bool_,
                                   np.float16, np.int64, np.complex64])
def test_collectives_of_every_dtype(dtype):
  x = (np.arange(8 * 8 * 3).reshape(8, 8, 3) % 3).astype(dtype)
  ring = [(k, (k + 1) % 8) for k in range(8)]
  out = tfspmd.pmap(lambda v: (lax.all_to_all(v, "i", 0, 0),
                               lax.ppermute(v, "i", ring),
                               lax.all_gather(v, "i")), axis_name="i")(x)
  np.testing.assert_array_equal(np.asarray(out[0]), np.swapaxes(x, 0, 1))
  np.testing.assert_array_equal(np.asarray(out[1]), np.roll(x, 1, axis=0))
  np.testing.assert_array_equal(np.asarray(out[2]), np.broadcast_to(x, (8,) + x.shape))


@pytest.mark.parametrize("order", [[7, 6, 5, 4, 3, 2, 1, 0], [3, 1, 0, 2, 7, 5, 4, 6]])
def test_collectives_on_devices_out_of_id_order(order):
  # DTensor's all-to-all and gather lowerings put blocks in device id order;
  # position k of the axis must still be the k-th device given.
  devices = [tfspmd.devices()[k] for k in order]
  x = np.arange(64, dtype=np.float32).reshape(8, 8)
  ring = [(k, (k + 1) % 8) for k in range(8)]

  def per_device(v):
    return (lax.all_gather(v, "i"), lax.ppermute(v, "i", ring),
            lax.all_to_all(v, "i", 0, 0), lax.psum_scatter(v, "i"),
            lax.axis_index("i"))

  out = [np.asarray(o) for o in tfspmd.pmap(per_device, "i", devices=devices)(x)]
  np.testing.assert_array_equal(out[0], np.broadcast_to(x, (8, 8, 8)))
  np.testing.assert_array_equal(out[1], np.roll(x, 1, axis=0))
  np.testing.assert_array_equal(out[2], x.T)
  np.testing.assert_array_equal(out[3], x.sum(0))
  np.testing.assert_array_equal(out[4], np.arange(8))


def test_pmean_of_integers_keeps_their_precision():
  big = np.array([2 ** 40, 2 ** 40 + 3], np.int64)
  mean64 = tfspmd.pmap(lambda v: lax.pmean(v, "i"), "i")(big)
  assert mean64.dtype == tf.float64
  np.testing.assert_array_equal(mean64, [2 ** 40 + 1.5] * 2)  # exact
  for dtype, expected in [(np.int32, tf.float32), (np.uint32, tf.float64),
                          (np.uint64, tf.float64), (np.int8, tf.float32)]:
    out = tfspmd.pmap(lambda v: lax.pmean(v, "i"), "i")(np.array([1, 2], dtype))
    assert out.dtype == expected, dtype
    np.testing.assert_array_equal(out, [1.5, 1.5])


def test_a_pytree_reduces_each_floating_dtype_in_one_all_reduce(monkeypatch):
  from tfspmd._src.collectives import reductions  # pylint: disable=import-outside-toplevel
  reduced = []
  psum_leaf = reductions._psum_leaf  # pylint: disable=protected-access

  def counting(value, *args, **kwargs):
    reduced.append((value.dtype.name, tuple(value.shape)))
    return psum_leaf(value, *args, **kwargs)

  monkeypatch.setattr(reductions, "_psum_leaf", counting)
  n = 8
  tree = {"w": data(n, 3, 2), "b": data(n, 2, seed=1),
          "wide": data(n, 2, dtype=np.float64, seed=2),
          "count": np.arange(n, dtype=np.int32)}

  def both(t):
    summed = lax.psum(t, "i")
    mean = lax.pmean({"w": t["w"], "b": t["b"], "scale": 2.0}, "i")
    return summed, mean

  summed, mean = tfspmd.pmap(both, "i")(tree)
  for name, value in tree.items():
    np.testing.assert_allclose(np.asarray(summed[name]),
                               np.broadcast_to(value.sum(0), value.shape),
                               rtol=1e-5)
  for name in ("w", "b"):
    np.testing.assert_allclose(
        np.asarray(mean[name]),
        np.broadcast_to(tree[name].mean(0), tree[name].shape), rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(mean["scale"]), 2.0)
  # psum: the two float32 leaves in one (8 elements), float64 and int32
  # alone; pmean: its two float32 leaves in one.
  assert sorted(reduced) == sorted([("float32", (8,)), ("float64", (2,)),
                                    ("int32", ()), ("float32", (8,))])


def test_the_gradient_of_a_pytree_reduced_in_one_all_reduce():
  n = 4
  w, b = data(n, 3, 2), data(n, 2, seed=1)
  weights = np.random.default_rng(5).standard_normal((2,)).astype(np.float32)

  def loss(w, b):
    summed = lax.pmean({"w": w, "b": b}, "i")
    return tf.reduce_sum(summed["w"] * weights) + tf.reduce_sum(
        summed["b"] ** 2)

  def per_device(w, b):
    with tf.GradientTape() as tape:
      tape.watch([w, b])
      value = loss(w, b)
    return tape.gradient(value, [w, b])

  grad_w, grad_b = tfspmd.pmap(per_device, "i")(w, b)
  # Each device's tape seeds its own copy of the loss, and pmean's
  # transpose is pmean (the README's convention): each device gets the
  # mean of the devices' cotangents, which are all the same.
  np.testing.assert_allclose(np.asarray(grad_w),
                             np.broadcast_to(weights, w.shape), rtol=1e-5)
  np.testing.assert_allclose(
      np.asarray(grad_b), np.broadcast_to(2 * b.mean(0), b.shape), rtol=1e-5)
