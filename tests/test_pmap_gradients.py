"""A GradientTape around a pmap call, and the convention for invariant losses.

Expected gradients are written out with NumPy (analytic) or come from
central finite differences of the pmapped program.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import lax

import numpy_reference
from numpy_reference import data


def tape_gradient(mapped, x, weights):
  x = tf.constant(x)
  with tf.GradientTape() as tape:
    tape.watch(x)
    loss = tf.reduce_sum(mapped(x) * weights)
  return tape.gradient(loss, x).numpy()


def test_mapped_input_through_psum_matches_numpy():
  x = data(4, 3)
  grad = tape_gradient(tfspmd.pmap(lambda v: v * lax.psum(v, "i"), "i"), x, 1.)
  # d/dx_k sum_i x_i * S = S + sum_i x_i = 2 S, S = sum_i x_i.
  np.testing.assert_allclose(grad, np.broadcast_to(2 * x.sum(0), x.shape), rtol=1e-5)


def test_broadcast_input_and_read_variable_match_numpy():
  x, w = data(4, 2), data(2, seed=1)
  v = tf.Variable(data(2, seed=2))
  w_tensor = tf.constant(w)
  f = tfspmd.pmap(lambda a, b: a * b * v, "i", in_axes=(0, None))
  with tf.GradientTape() as tape:
    tape.watch(w_tensor)
    loss = tf.reduce_sum(f(x, w_tensor))
  grad_w, grad_v = tape.gradient(loss, [w_tensor, v])
  np.testing.assert_allclose(grad_w, (x * v.numpy()).sum(0), rtol=1e-5)
  np.testing.assert_allclose(grad_v, (x * w).sum(0), rtol=1e-5)


@pytest.mark.parametrize("name", ["all_gather", "ppermute", "psum_scatter",
                                  "all_to_all", "pmax"])
def test_collectives_inside_match_finite_differences(name):
  collectives = {
      "all_gather": lambda v: lax.all_gather(v, "i") * v[0],
      "ppermute": lambda v: lax.ppermute(v, "i", [(0, 1), (1, 3), (3, 0)]) * v,
      "psum_scatter": lambda v: lax.psum_scatter(v * v, "i", tiled=True),
      "all_to_all": lambda v: lax.all_to_all(v, "i", 0, 0) ** 2,
      "pmax": lambda v: lax.pmax(v, "i") * v,
  }
  mapped = tfspmd.pmap(collectives[name], "i")
  x = data(4, 4)
  weights = data(*np.asarray(mapped(x)).shape, seed=3)
  expected = numpy_reference.finite_difference(
      lambda value: float(np.sum(np.asarray(mapped(value)) * weights)), x)
  np.testing.assert_allclose(tape_gradient(mapped, x, weights), expected,
                             rtol=2e-2, atol=2e-2)


def test_an_output_returned_once_is_one_value():
  x = data(4, 3)
  f = tfspmd.pmap(lambda v: lax.psum(v ** 2, "i"), "i", out_axes=None)
  np.testing.assert_allclose(tape_gradient(f, x, 1.), 2 * x, rtol=1e-5)


def test_nested_pmaps_under_a_tape():
  x = data(2, 4, 2)
  f = tfspmd.pmap(tfspmd.pmap(lambda v: v * lax.psum(v, ("i", "j")),
                              axis_name="j"), axis_name="i")
  np.testing.assert_allclose(tape_gradient(f, x, 1.),
                             np.broadcast_to(2 * x.sum((0, 1)), x.shape), rtol=1e-5)


def test_integer_inputs_get_no_gradient_and_results_are_tensors():
  x, k = tf.constant(data(4, 2)), tf.range(4)
  with tf.GradientTape() as tape:
    tape.watch(x)
    out = tfspmd.pmap(lambda a, b: a * tf.cast(b, tf.float32), "i")(x, k)
    loss = tf.reduce_sum(out)
  assert isinstance(out, tf.Tensor)
  grad_x, grad_k = tape.gradient(loss, [x, k])
  np.testing.assert_allclose(grad_x, np.broadcast_to(np.arange(4.)[:, None], (4, 2)))
  assert grad_k is None
  assert isinstance(tfspmd.pmap(lambda a: a)(x), tfspmd.ShardedArray)


def test_gradient_of_an_invariant_loss_counts_every_devices_copy():
  """psum(loss) differentiated inside: each device seeds its copy of it.

  A GradientTape inside the mapped function differentiates that device's
  program, whose output psum(loss) is one of n copies of the total; the
  transpose of psum is psum, so the gradient is n times the device's own
  d loss_i / d w (the behaviour of JAX issue 3970; JAX since its
  varying-manual-axes typing gives 1 times). Differentiate the local loss
  and pmean the gradients to get the data-parallel gradient.
  """
  x, w = data(4, 3), data(3, seed=1)

  def grads(v, weights):
    with tf.GradientTape(persistent=True) as tape:
      tape.watch(weights)
      local = tf.reduce_sum(v * weights) ** 2
      total = lax.psum(local, "i")
    return tape.gradient(total, weights), lax.pmean(tape.gradient(local, weights), "i")

  of_total, mean_of_local = tfspmd.pmap(grads, "i", in_axes=(0, None))(x, w)
  local = 2 * (x @ w)[:, None] * x
  np.testing.assert_allclose(of_total, 4 * local, rtol=1e-5)
  np.testing.assert_allclose(mean_of_local, np.broadcast_to(local.mean(0), (4, 3)), rtol=1e-5)


def test_unsupported_outer_gradient_raises_instead_of_a_wrong_number():
  f = tfspmd.pmap(tfspmd.pmap(lambda v: lax.pmax(v, "i") * v, axis_name="j"),
                  axis_name="i")
  x = tf.constant(data(2, 4))
  with pytest.raises(NotImplementedError, match="open the tape inside"):
    with tf.GradientTape() as tape:
      tape.watch(x)
      loss = tf.reduce_sum(f(x))
    tape.gradient(loss, x)


# --- tfspmd.grad and tfspmd.value_and_grad (jax.grad's names) ----------------

N = 8


def _mlp_loss(params, x, y):
  hidden = tf.tanh(x @ params["layers"][0]["w"] + params["layers"][0]["b"])
  out = hidden @ params["layers"][1]["w"]
  loss = tf.reduce_mean((out - y) ** 2)
  return loss, {"out": out}


def _mlp_numpy(params, x, y):
  """The loss and its gradients with respect to params, by hand."""
  w0, b0 = params["layers"][0]["w"], params["layers"][0]["b"]
  w1 = params["layers"][1]["w"]
  hidden = np.tanh(x @ w0 + b0)
  out = hidden @ w1
  d_out = 2. * (out - y) / out.size
  d_hidden = d_out @ w1.T * (1. - hidden ** 2)
  grads = {"layers": [{"w": x.T @ d_hidden, "b": d_hidden.sum(0)},
                      {"w": hidden.T @ d_out}]}
  return np.mean((out - y) ** 2), grads, x @ w0


def _mlp_params(seed=0):
  rng = np.random.default_rng(seed)
  return {"layers": [
      {"w": rng.standard_normal((3, 4)).astype(np.float32),
       "b": rng.standard_normal(4).astype(np.float32)},
      {"w": rng.standard_normal((4, 2)).astype(np.float32)}]}


def _assert_tree_close(got, want, rtol=1e-5):
  got_leaves, got_tree = tfspmd.tree_util.tree_flatten(got)
  want_leaves, want_tree = tfspmd.tree_util.tree_flatten(want)
  assert got_tree == want_tree
  for g, w in zip(got_leaves, want_leaves):
    np.testing.assert_allclose(np.asarray(g), w, rtol=rtol, atol=1e-6)


@pytest.mark.parametrize("in_function", [False, True])
def test_value_and_grad_of_a_pytree_with_aux(in_function):
  params, x, y = _mlp_params(), data(5, 3), data(5, 2, seed=1)
  step = tfspmd.value_and_grad(_mlp_loss, has_aux=True)
  if in_function:
    step = tf.function(step)
  (loss, aux), grads = step(
      tf.nest.map_structure(tf.constant, params), x, y)
  want_loss, want_grads, _ = _mlp_numpy(params, x, y)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  _assert_tree_close(grads, want_grads)
  assert aux["out"].shape == (5, 2)


def test_grad_of_several_arguments_and_of_an_unused_leaf():
  x, w = np.float32(1.5), np.array([1., -2.], np.float32)
  f = lambda x, w, unused: tf.reduce_sum(w * x ** 3) + 0. * x
  # d/dx = 3 x^2 sum(w), d/dw = x^3; an unused leaf gets zeros, as in JAX.
  gx, gw = tfspmd.grad(f, argnums=(0, 1))(x, w, 0.)
  np.testing.assert_allclose(gx, 3. * x ** 2 * w.sum(), rtol=1e-6)
  np.testing.assert_allclose(gw, np.full(2, x ** 3), rtol=1e-6)
  grads, aux = tfspmd.grad(lambda p: (p["a"] * 2., "aux"), has_aux=True)(
      {"a": 1., "b": [np.float32(2.)]})
  assert aux == "aux" and float(grads["a"]) == 2.
  assert float(grads["b"][0]) == 0.
  # grad of grad, as JAX nests them: d2/dx2 x^3 = 6 x.
  second = tfspmd.grad(tfspmd.grad(lambda x: x ** 3))(tf.constant(2.))
  np.testing.assert_allclose(second, 12., rtol=1e-6)


def test_grad_inside_a_pmap_is_each_devices_gradient(each_executor):
  params = _mlp_params()
  x, y = data(N, 5, 3), data(N, 5, 2, seed=1)

  def train_step(params, x, y):
    (loss, _), grads = tfspmd.value_and_grad(_mlp_loss, has_aux=True)(
        params, x, y)
    return loss, grads, lax.pmean(grads, "i")

  loss, grads, mean = tfspmd.pmap(train_step, "i", in_axes=(None, 0, 0))(
      params, x, y)
  per_device = [_mlp_numpy(params, x[k], y[k]) for k in range(N)]
  np.testing.assert_allclose(loss, [p[0] for p in per_device], rtol=1e-5)
  for k in (0, N - 1):
    _assert_tree_close(tf.nest.map_structure(lambda g: np.asarray(g)[k], grads),
                       per_device[k][1])
  want_mean = tf.nest.map_structure(lambda *g: np.mean(g, 0),
                                    *[p[1] for p in per_device])
  _assert_tree_close(tf.nest.map_structure(lambda g: np.asarray(g)[3], mean),
                     want_mean)


@pytest.mark.parametrize("call, match", [
    (lambda: tfspmd.grad(lambda x: x * 2.)(tf.ones(2)),
     r"tfspmd.grad: the function must return a floating-point scalar, as in "
     r"jax.grad, got float32\[2\]; reduce it first"),
    (lambda: tfspmd.grad(lambda n: tf.cast(n, tf.float32))(3),
     r"tfspmd.grad: args\[0\] has dtype int32; gradients are taken with "
     r"respect to floating-point leaves only"),
    (lambda: tfspmd.value_and_grad(lambda x: x, has_aux=True)(1.),
     r"tfspmd.value_and_grad: with has_aux=True the function must return a "
     r"pair \(value, aux\)"),
    (lambda: tfspmd.grad(lambda x: x, argnums=1)(1.),
     r"tfspmd.grad: argnums names argument 1, but the function was called "
     r"with 1 positional arguments"),
])
def test_grad_says_what_it_expected(call, match):
  with pytest.raises(TypeError, match=match):
    call()
