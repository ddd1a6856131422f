"""shard_map over named meshes, against NumPy (8 logical CPU devices).

Its errors are in the catalogue (tests/error_cases_shard_map.py, group "shard_map and
meshes").
"""

import dataclasses
import functools

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.experimental import dtensor

import tfspmd
from tfspmd import P
from tfspmd import lax

from numpy_reference import data


@pytest.fixture(name="mesh")
def fixture_mesh():
  return tfspmd.make_mesh((2, 4), ("data", "model"))


def sharding(result):
  return list(dtensor.fetch_layout(result.dtensor_value).sharding_specs)


def test_make_mesh_and_mesh_attributes(mesh):
  assert mesh.axis_names == ("data", "model")
  assert mesh.shape == {"data": 2, "model": 4}
  assert mesh.size == 8
  assert mesh.devices.shape == (2, 4)
  assert tuple(mesh.devices.flat) == tuple(tfspmd.devices())
  assert mesh.dtensor_mesh.dim_names == ["data", "model"]
  assert mesh.dtensor_mesh.shape() == [2, 4]
  assert mesh.dim_names == ("data", "model")
  same = tfspmd.Mesh(np.array(tfspmd.devices()).reshape(2, 4), ("data", "model"))
  assert same == mesh
  assert P is tfspmd.PartitionSpec
  assert repr(P("data", None)) == "PartitionSpec('data', None)"


def test_elementwise_on_1d_and_2d_meshes(mesh):
  x = data(8, 12)
  line = tfspmd.make_mesh((8,), ("i",))
  out = tfspmd.shard_map(lambda b: b * 2 + 1, mesh=line, in_specs=P("i"),
                         out_specs=P("i"))(x)
  assert out.shape == (8, 12)
  np.testing.assert_allclose(out, x * 2 + 1, rtol=1e-6)
  assert sharding(out) == ["i", "unsharded"]

  def block_shape_and_exp(b):
    assert b.shape == (4, 3)
    return tf.exp(b)

  out = tfspmd.shard_map(block_shape_and_exp, mesh=mesh,
                         in_specs=P("data", "model"),
                         out_specs=P("data", "model"))(x)
  np.testing.assert_allclose(out, np.exp(x), rtol=1e-6)
  assert sharding(out) == ["data", "model"]


@pytest.mark.parametrize("spec, split", [
    (P("model"), ["model", "unsharded"]),
    (P(None, "model"), ["unsharded", "model"]),
    (P("data"), ["data", "unsharded"]),
    (P("model", "data"), ["model", "data"]),
], ids=str)
def test_an_output_split_over_any_mesh_axis_stays_split(mesh, spec, split):
  x = data(8, 8)
  out = tfspmd.shard_map(lambda b: b - 1, mesh=mesh, in_specs=spec,
                         out_specs=spec)(x)
  np.testing.assert_allclose(out, x - 1, rtol=1e-6)
  assert sharding(out) == split


def test_matmul_with_the_contracting_dimension_split(mesh):
  a, b = data(8, 16), data(16, 12, seed=1)

  @functools.partial(tfspmd.shard_map, mesh=mesh,
                     in_specs=(P("data", "model"), P("model", None)),
                     out_specs=P("data", None))
  def matmul_psum(x, y):
    return lax.psum(x @ y, "model")

  out = matmul_psum(a, b)
  np.testing.assert_allclose(out, a @ b, rtol=1e-4, atol=1e-4)
  assert sharding(out) == ["data", "unsharded"]

  @functools.partial(tfspmd.shard_map, mesh=mesh,
                     in_specs=(P("data", "model"), P("model", None)),
                     out_specs=P("data", "model"))
  def matmul_scatter(x, y):
    return lax.psum_scatter(x @ y, "model", scatter_dimension=1, tiled=True)

  out = matmul_scatter(a, b)
  np.testing.assert_allclose(out, a @ b, rtol=1e-4, atol=1e-4)
  assert sharding(out) == ["data", "model"]


def test_all_gather_to_a_replicated_output_and_a_replicated_input(mesh):
  x, w = data(8, 4), data(4, 3, seed=1)

  def gather_rows(block, weights):
    assert weights.shape == (4, 3)  # the whole array on every device
    return lax.all_gather(block @ weights, ("data", "model"), tiled=True)

  out = tfspmd.shard_map(gather_rows, mesh=mesh,
                         in_specs=(P(("data", "model")), P()),
                         out_specs=P())(x, w)
  np.testing.assert_allclose(out, x @ w, rtol=1e-5)
  assert sharding(out) == ["unsharded", "unsharded"]


def test_a_dimension_split_over_two_axes_with_axis_index_of_both(mesh):
  def positions(block):
    data_index = tf.cast(lax.axis_index("data"), tf.float32)
    model_index = tf.cast(lax.axis_index("model"), tf.float32)
    linear = tf.cast(lax.axis_index(("data", "model")), tf.float32)
    return tf.stack([block[:, 0] * 0 + data_index, block[:, 0] * 0 + model_index,
                     block[:, 0] * 0 + linear], axis=1)

  out = tfspmd.shard_map(positions, mesh=mesh, in_specs=P(("data", "model")),
                         out_specs=P(("data", "model")))(np.zeros((16, 2), np.float32))
  rows = np.arange(16) // 2  # two rows per device, device k = 4 * data + model
  np.testing.assert_array_equal(out, np.stack([rows // 4, rows % 4, rows], 1))

  swapped = tfspmd.shard_map(positions, mesh=mesh, in_specs=P(("model", "data")),
                             out_specs=P(("model", "data")))(np.zeros((16, 2), np.float32))
  # Split model-major: block k belongs to model k // 2, data k % 2.
  np.testing.assert_array_equal(
      swapped, np.stack([rows % 2, rows // 2, 4 * (rows % 2) + rows // 2], 1))


def test_ppermute_along_one_mesh_axis(mesh):
  x = data(2, 8)
  shift = [(k, (k + 1) % 4) for k in range(4)]
  out = tfspmd.shard_map(lambda b: lax.ppermute(b, "model", shift), mesh=mesh,
                         in_specs=P("data", "model"),
                         out_specs=P("data", "model"))(x)
  expected = np.roll(x.reshape(2, 4, 2), 1, axis=1).reshape(2, 8)
  np.testing.assert_array_equal(out, expected)


def test_gradients_around_and_inside(mesh):
  a, b = data(8, 16), data(16, 4, seed=1)
  loss_fn = tfspmd.shard_map(
      lambda x, y: lax.psum(tf.reduce_sum(tf.tanh(x @ y)), ("data", "model")),
      mesh=mesh, in_specs=(P("data", "model"), P("model", None)), out_specs=P())
  a_var = tf.constant(a)
  with tf.GradientTape() as tape:
    tape.watch(a_var)
    loss = tf.convert_to_tensor(loss_fn(a_var, b))
  grad = tape.gradient(loss, a_var)
  # Each device's partial product of its blocks: A_dm @ B_m.
  loss_expected, grad_expected = 0.0, np.zeros_like(a, dtype=np.float64)
  for d in range(2):
    for m in range(4):
      rows, cols = slice(4 * d, 4 * d + 4), slice(4 * m, 4 * m + 4)
      product = np.tanh(a[rows, cols].astype(np.float64) @ b[cols])
      loss_expected += product.sum()
      grad_expected[rows, cols] = (1 - product ** 2) @ b[cols].T
  np.testing.assert_allclose(loss, loss_expected, rtol=1e-4)
  np.testing.assert_allclose(grad, grad_expected, rtol=1e-4, atol=1e-5)

  def local_gradient(x, y):
    with tf.GradientTape() as inner:
      inner.watch(y)
      partial = tf.reduce_sum(tf.tanh(x @ y))
    return lax.psum(inner.gradient(partial, y), "data")

  out = tfspmd.shard_map(local_gradient, mesh=mesh,
                         in_specs=(P("data", "model"), P("model", None)),
                         out_specs=P("model", None))(a, b)
  # Model block m holds rows m of b; its gradient sums the data blocks.
  reference = np.zeros_like(b, dtype=np.float64)
  for m in range(4):
    cols = slice(4 * m, 4 * m + 4)
    a_m = a[:, cols].astype(np.float64)
    reference[cols] = a_m.T @ (1 - np.tanh(a_m @ b[cols]) ** 2)
  np.testing.assert_allclose(out, reference, rtol=1e-4, atol=1e-4)


def split_over(mesh, x):
  """`x` (8, 12) as a DTensor split (data, model) over the 2 x 4 mesh."""
  layout = dtensor.Layout(["data", "model"], mesh.dtensor_mesh)
  return dtensor.pack(
      [x[4 * (k // 4):4 * (k // 4) + 4, 3 * (k % 4):3 * (k % 4) + 3]
       for k in range(8)], layout), layout


def test_dtensors_in_and_out_with_their_layouts(mesh):
  x = data(8, 12)
  placed, layout = split_over(mesh, x)
  double = tfspmd.shard_map(lambda b: b * 2, mesh=mesh,
                            in_specs=P("data", "model"),
                            out_specs=P("data", "model"))
  out = double(placed)
  np.testing.assert_array_equal(out, x * 2)
  assert dtensor.fetch_layout(out.dtensor_value) == layout

  # The result feeds DTensor code, which feeds another shard_map.
  summed = tf.reduce_sum(out.dtensor_value, axis=1)
  np.testing.assert_allclose(dtensor.unpack(summed)[0].numpy(),
                             (x * 2).sum(1)[:4], rtol=1e-5)
  again = double(out)
  np.testing.assert_array_equal(again, x * 4)

  # A DTensor laid out otherwise (whole on every device) is relaid out.
  whole = dtensor.copy_to_mesh(tf.constant(x),
                               dtensor.Layout.replicated(mesh.dtensor_mesh, 2))
  np.testing.assert_array_equal(double(whole), x * 2)


def test_inside_a_users_tf_function_between_dtensor_ops(mesh):
  x = data(8, 12)
  placed, _ = split_over(mesh, x)
  row_sums = tfspmd.shard_map(
      lambda b: lax.psum(tf.reduce_sum(b, 1, keepdims=True), "model"),
      mesh=mesh, in_specs=P("data", "model"), out_specs=P("data", None))

  @tf.function
  def program(v):
    return row_sums(tf.nn.relu(v)) * 2.

  out = program(placed)
  assert dtensor.fetch_layout(out) == dtensor.Layout(
      ["data", dtensor.UNSHARDED], mesh.dtensor_mesh)
  expected = 2 * np.maximum(x, 0).sum(1, keepdims=True)
  pieces = dtensor.unpack(out)
  np.testing.assert_allclose(pieces[0], expected[:4], rtol=1e-5)
  np.testing.assert_allclose(pieces[4], expected[4:], rtol=1e-5)


@pytest.fixture(name="calls")
def fixture_calls(monkeypatch):
  """Counts the DTensor relayouts and packs made from here on."""
  counts = {"relayout": 0, "pack": 0}
  for name in counts:
    original = getattr(dtensor, name)

    def counted(*args, _name=name, _original=original, **kwargs):
      counts[_name] += 1
      return _original(*args, **kwargs)

    monkeypatch.setattr(dtensor, name, counted)
  return counts


def test_a_dtensor_laid_out_with_the_mesh_axis_names_goes_through_as_it_is(
    request, dtensor_executor):
  # DTensor's executor moves blocks between layouts; the host's takes whole arrays.
  del dtensor_executor  # unused
  line = tfspmd.make_mesh((8,), ("x",))
  layout = dtensor.Layout(["x", dtensor.UNSHARDED], line.dtensor_mesh)
  x = data(16, 3)
  placed = dtensor.pack([x[2 * k:2 * k + 2] for k in range(8)], layout)
  double = tfspmd.shard_map(lambda b: b * 2, mesh=line, in_specs=P("x"),
                            out_specs=P("x"))
  double(placed)  # traced here; the call below runs the program only
  calls = request.getfixturevalue("calls")
  out = double(placed)
  assert calls == {"relayout": 0, "pack": 0}
  assert dtensor.fetch_layout(out.dtensor_value) == layout
  pieces = dtensor.unpack(out.dtensor_value)
  for k in range(8):
    np.testing.assert_array_equal(pieces[k], x[2 * k:2 * k + 2] * 2)


def test_results_lie_on_the_mesh_as_the_out_specs_say(mesh):
  x = data(8, 12)
  transpose = tfspmd.shard_map(lambda b: tf.transpose(b) + 1, mesh=mesh,
                               in_specs=P("data", "model"),
                               out_specs=P("model", "data"))
  out = transpose(x)
  np.testing.assert_allclose(out, x.T + 1, rtol=1e-6)
  assert dtensor.fetch_layout(out.dtensor_value) == dtensor.Layout(
      ["model", "data"], mesh.dtensor_mesh)
  pieces = dtensor.unpack(out.dtensor_value)
  for k in range(8):  # device k is data k // 4, model k % 4
    d, m = divmod(k, 4)
    np.testing.assert_allclose(
        pieces[k], x.T[3 * m:3 * m + 3, 4 * d:4 * d + 4] + 1, rtol=1e-6)


def test_a_shard_map_result_and_a_pmap_result_on_the_same_devices_add(
    request, dtensor_executor):
  # DTensor's executor moves blocks between layouts; the host's takes whole arrays.
  del dtensor_executor  # unused
  line = tfspmd.make_mesh((8,), ("x",))
  x = data(8, 3)
  mapped = tfspmd.shard_map(lambda b: b * 2, mesh=line, in_specs=P("x"),
                            out_specs=P("x"))(x)
  pmapped = tfspmd.pmap(lambda row: row + 1)(x)
  total = mapped + pmapped
  np.testing.assert_allclose(total, x * 3 + 1, rtol=1e-6)
  assert total.placement.spec == ("x", None)
  np.testing.assert_allclose(pmapped - mapped, 1 - x, rtol=1e-6)
  # Either goes into the other's kind of map.
  np.testing.assert_allclose(tfspmd.pmap(lambda row: row * row)(mapped),
                             (x * 2) ** 2, rtol=1e-6)
  negate = tfspmd.shard_map(lambda b: -b, mesh=line, in_specs=P("x"),
                            out_specs=P("x"))
  np.testing.assert_allclose(negate(pmapped), -(x + 1), rtol=1e-6)
  # Each device keeps its block: no relayout, no trip through the host.
  calls = request.getfixturevalue("calls")
  negate(pmapped)
  assert calls == {"relayout": 0, "pack": 1}


def test_mesh_axis_names_dtensor_cannot_take_name_its_dimensions_by_position():
  mesh = tfspmd.make_mesh((2, 4), (0, "model"))
  assert mesh.dim_names == ("axis_0", "axis_1")
  x = data(8, 4)
  out = tfspmd.shard_map(lambda b: lax.psum(b, "model"), mesh=mesh,
                         in_specs=P(0, "model"), out_specs=P(0))(x)
  expected = x.reshape(8, 4, 1).sum(1)
  np.testing.assert_allclose(out, expected, rtol=1e-5)
  assert sharding(out) == ["axis_0", "unsharded"]


def test_a_pmap_inside_takes_a_free_dimension_name_beside_the_mesh_axes():
  # The pmap at depth 2 would be named axis_2, the name of a mesh axis here.
  grid = tfspmd.make_mesh((2, 2), ("axis_2", "b"), devices=tfspmd.devices()[:4])
  x = np.arange(12.).reshape(4, 3)

  def f(block):  # one row per device; the inner pmap maps over it
    return tfspmd.pmap(lambda row: lax.psum(row, "axis_2"), "inner")(block)

  out = tfspmd.shard_map(f, mesh=grid, in_specs=P(("axis_2", "b")),
                         out_specs=P(("axis_2", "b")))(x)
  np.testing.assert_array_equal(out, np.tile(x.reshape(2, 2, 3).sum(0), (2, 1)))


def positions_times_ten(block):
  """10 * the block, plus 100 * its 'a' position and its 'b' position."""
  offset = 100 * lax.axis_index("a") + lax.axis_index("b")
  return block * 10 + tf.cast(offset, block.dtype)


@pytest.mark.parametrize("out_spec", [P("a"), P(None, "b")], ids=str)
def test_check_vma_false_takes_the_first_devices_block_along_an_axis_left_out(
    out_spec):
  grid = tfspmd.make_mesh((2, 4), ("a", "b"))
  x = np.arange(32.).reshape(8, 4)
  out = tfspmd.shard_map(positions_times_ten, mesh=grid,
                         in_specs=P("a", "b"), out_specs=out_spec,
                         check_vma=False)(x)
  rows, cols = np.meshgrid(np.arange(8), np.arange(4), indexing="ij")
  whole = x * 10 + 100 * (rows // 4) + cols  # every device's block, in place
  if out_spec == P("a"):
    expected = whole[:, :1]  # the blocks of b = 0, one per a
  else:
    expected = whole[:4]  # the blocks of a = 0, one per b
  np.testing.assert_array_equal(out, expected)
  with pytest.raises(ValueError, match="varies along the mesh axis"):
    tfspmd.shard_map(positions_times_ten, mesh=grid, in_specs=P("a", "b"),
                     out_specs=out_spec)(x)


def test_check_vma_false_keeps_an_output_that_is_the_same_along_the_axis(mesh):
  x = data(8, 4)
  out = tfspmd.shard_map(lambda b: lax.psum(b, "model"), mesh=mesh,
                         in_specs=P("data", "model"), out_specs=P("data"),
                         check_vma=False)(x)
  np.testing.assert_allclose(out, x.reshape(8, 4, 1).sum(1), rtol=1e-5)


def test_a_dimension_split_over_two_axes_lies_split_over_both(mesh):
  x = data(16, 3)
  out = tfspmd.shard_map(lambda b: b + 1, mesh=mesh,
                         in_specs=P(("data", "model")),
                         out_specs=P(("data", "model")))(x)
  np.testing.assert_allclose(out, x + 1, rtol=1e-6)
  assert out.sharding == tfspmd.sharding.NamedSharding(
      mesh, P(("data", "model")))
  # As in JAX, the device at (d, m) holds block 4 d + m of 2 rows; the
  # DTensor lies on a mesh of the same devices whose one dimension merges
  # 'data' and 'model'.
  assert dtensor.fetch_layout(out.dtensor_value).sharding_specs == [
      "data.model", dtensor.UNSHARDED]
  shards = out.addressable_shards
  assert [shard.device for shard in shards] == list(mesh.devices.flat)
  for (d, m), device in np.ndenumerate(mesh.devices):
    (shard,) = [s for s in shards if s.device == device]
    rows = slice(2 * (4 * d + m), 2 * (4 * d + m) + 2)
    assert shard.index == (rows, slice(None))
    np.testing.assert_allclose(shard.data, x[rows] + 1, rtol=1e-6)


def test_python_numbers_take_tensorflow_dtypes_and_inputs_may_be_results(mesh):
  scale = tfspmd.shard_map(lambda b, s: b * s, mesh=mesh,
                           in_specs=(P("data"), P()), out_specs=P("data"))
  out = scale(np.ones(4, np.float32), 3.0)
  assert out.dtype == tf.float32
  np.testing.assert_array_equal(out, np.full(4, 3.0))
  again = scale(out, 2.0)  # a result goes back in as it lies
  np.testing.assert_array_equal(again, np.full(4, 6.0))


def test_specs_are_tree_prefixes_of_arguments_and_outputs(mesh):
  params = {"w": data(6, 8), "b": data(8, seed=1)}
  x = data(4, 6, seed=2)

  def layer(p, rows):
    # Each device: its rows, its columns of w and b.
    return {"h": rows @ p["w"] + p["b"], "rows": rows}

  out = tfspmd.shard_map(
      layer, mesh=mesh,
      in_specs=({"w": P(None, "model"), "b": P("model")}, P("data")),
      out_specs={"h": P("data", "model"), "rows": P("data")})(params, x)
  np.testing.assert_allclose(out["h"], x @ params["w"] + params["b"],
                             rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(out["rows"], x)


def test_specs_in_a_class_registered_as_a_pytree():
  @tfspmd.tree_util.register_dataclass
  @dataclasses.dataclass
  class Pair:
    a: object
    b: object

  mesh = tfspmd.make_mesh((8,), ("x",))
  out = tfspmd.shard_map(lambda p: Pair(p.a * 2, p.b), mesh=mesh,
                         in_specs=(Pair(P("x"), P()),),
                         out_specs=Pair(P("x"), P()))(
                             Pair(np.arange(8.), np.float32(1.)))
  np.testing.assert_array_equal(np.asarray(out.a), np.arange(8.) * 2)
  np.testing.assert_array_equal(np.asarray(out.b), 1.)


def test_the_gradient_of_a_gather_at_indices_split_over_another_axis():
  # seqax's token lookup: the table split over 'sp', the ids over 'fsdp';
  # the indices differ along both axes, the table along one.
  mesh = tfspmd.make_mesh((1, 2, 1, 4), ("dp", "fsdp", "tp", "sp"))
  table = np.arange(32 * 3, dtype=np.float32).reshape(32, 3)
  ids = np.arange(16, dtype=np.int32).reshape(2, 8) % 5

  def gradient(table_block, ids_block):
    with tf.GradientTape() as tape:
      tape.watch(table_block)
      rows = tf.gather(table_block, ids_block[0] + lax.axis_index("sp"))
      rows = lax.psum(rows, "sp")
      loss = tf.reduce_sum(rows * rows)
    return tape.gradient(loss, table_block)

  out = tfspmd.shard_map(gradient, mesh=mesh, in_specs=(P("sp"), P("fsdp")),
                         out_specs=P("sp"), check_vma=False)(table, ids)
  # The block of 'sp' device k comes from the first 'fsdp' device: its ids
  # row 0. psum's transpose is psum, so 4 devices' cotangents 2 * R meet.
  blocks = table.reshape(4, 8, 3)
  total = sum(blocks[k][ids[0] + k] for k in range(4))
  expected = np.zeros_like(blocks)
  for k in range(4):
    np.add.at(expected[k], ids[0] + k, 8 * total)
  np.testing.assert_array_equal(np.asarray(out), expected.reshape(32, 3))


def test_the_gradient_of_tied_embedding_logits_written_with_an_ellipsis():
  # A transformer's output layer shares its token embedding: the logits are
  # an einsum with '...', whose gradient TensorFlow writes as
  # '...v,vd...->...d' (an ellipsis covering no axes of the embedding).
  mesh = tfspmd.make_mesh((2, 4), ("dp", "tp"))
  h = np.arange(4 * 3 * 2, dtype=np.float32).reshape(4, 3, 2) / 10
  emb = np.arange(8 * 2, dtype=np.float32).reshape(8, 2) / 7

  def loss(h_block, emb_block):
    logits = tf.einsum("...d,vd->...v", h_block, emb_block)
    return lax.psum(tf.reduce_sum(logits * logits), ("dp", "tp"))

  h_var, emb_var = tf.Variable(h), tf.Variable(emb)
  with tf.GradientTape() as tape:
    value = tfspmd.shard_map(loss, mesh=mesh, in_specs=(P("dp"), P("tp")),
                             out_specs=P())(h_var, emb_var)
  grad_h, grad_emb = tape.gradient(value, [h_var, emb_var])
  # JAX (jax.value_and_grad of jax.shard_map) gives 1092.5779, and the
  # gradients below.
  logits = np.einsum("bsd,vd->bsv", h, emb)
  np.testing.assert_allclose(np.asarray(value), (logits ** 2).sum(),
                             rtol=1e-6)
  np.testing.assert_allclose(np.asarray(grad_h),
                             2 * np.einsum("bsv,vd->bsd", logits, emb),
                             rtol=1e-5)
  np.testing.assert_allclose(np.asarray(grad_emb),
                             2 * np.einsum("bsv,bsd->vd", logits, h),
                             rtol=1e-5)


def test_an_einsum_with_a_broadcasting_ellipsis_of_replicated_operands(mesh):
  x = np.arange(2 * 1 * 3 * 2, dtype=np.float32).reshape(2, 1, 3, 2)
  y = np.arange(5 * 2 * 4, dtype=np.float32).reshape(5, 2, 4)
  out = tfspmd.shard_map(
      lambda a, b: tf.einsum("...ij,...jk->...ik", a, b), mesh=mesh,
      in_specs=(P(), P()), out_specs=P())(x, y)
  np.testing.assert_allclose(np.asarray(out), np.matmul(x, y), rtol=1e-6)
