"""The Lorenz ODE Solver colab's pmaps, in TensorFlow with tfspmd.

The program is JAX's Cloud TPU colab "Lorentz ODE Solver" by Alex Alemi
(github.com/jax-ml/jax, cloud_tpu_colabs/Lorentz_ODE_Solver.ipynb), its
section "Parallel ODE Solutions with Pmap", ported line by line:

* `tfspmd.pmap(rk4)` integrates the Lorenz system from a different initial
  state on every device: a loop whose trip count `N` is a mapped argument,
  writing row i of the trajectory at a traced index;
* `pplotter` draws each device's trajectory into that device's image with
  `drawline`, Wu's antialiased line algorithm: a loop over the segments,
  and in each segment `tf.cond`s on per-device data (is the segment steep?
  is it drawn right to left?) choosing which pixels the endpoints light,
  and a `tf.cond` whose two branches each run a loop between per-device
  pixel bounds. Every device takes its own branches and runs its own
  number of inner passes.

`tf` ops stand for `jnp`, `tf.cond` for `lax.cond`, a `tf.while_loop` for
each `lax.fori_loop` (JAX's own lowering of a fori_loop with traced
bounds), `tf.function` for `jit`, `tf.tensor_scatter_nd_add` / `_update`
for `.at[...].add` / `.set`. The initial states come from
`np.random.default_rng(0)`, and the sizes are small (100 steps, images of
40 x 30 pixels, against 4000 steps and 200 x 150 in the notebook); the
plotting limits are the notebook's.

Run: python -m examples.lorenz_ode
"""

import numpy as np
import tensorflow as tf

import tfspmd

N_DEV = 8
N = 100          # steps of the integrator
DT = 0.004
XN, ZN = 40, 30  # image size
XLIM, ZLIM = (-20, 20), (0, 50)

sigma = 10.
beta = 8. / 3
rho = 28.


def initial_states():
  """The notebook's `state0`, drawn with NumPy instead of jax.random."""
  rng = np.random.default_rng(0)
  state0 = rng.uniform(-1., 1., size=(N_DEV, 3)).astype(np.float32)
  return (state0 * np.array([18, 18, 1], np.float32) +
          np.array((0., 0., 10.), np.float32))


# The notebook's cells, in order.


@tf.function
def drawline(im, x0, y0, x1, y1):
  """An implementation of Wu's antialiased line algorithm.

  This functional version was adapted from here:
    https://en.wikipedia.org/wiki/Xiaolin_Wu's_line_algorithm
  """

  ipart = lambda x: tf.cast(tf.floor(x), tf.int32)
  round_ = lambda x: ipart(x + 0.5)
  fpart = lambda x: x - tf.floor(x)
  rfpart = lambda x: 1 - fpart(x)
  as_float = lambda i: tf.cast(i, tf.float32)

  def plot(im, x, y, c):
    return tf.tensor_scatter_nd_add(im, tf.stack([x, y])[None], c[None])

  steep = tf.abs(y1 - y0) > tf.abs(x1 - x0)
  cond_swap = lambda cond, x: tf.cond(cond, lambda: (x[1], x[0]), lambda: x)

  (x0, y0) = cond_swap(steep, (x0, y0))
  (x1, y1) = cond_swap(steep, (x1, y1))

  (y0, y1) = cond_swap(x0 > x1, (y0, y1))
  (x0, x1) = cond_swap(x0 > x1, (x0, x1))

  dx = x1 - x0
  dy = y1 - y0
  gradient = tf.where(dx == 0.0, 1.0, dy / dx)

  # handle first endpoint
  xend = round_(x0)
  yend = y0 + gradient * (as_float(xend) - x0)
  xgap = rfpart(x0 + 0.5)
  xpxl1 = xend  # this will be used in main loop
  ypxl1 = ipart(yend)

  def true_fun(im):
    im = plot(im, ypxl1, xpxl1, rfpart(yend) * xgap)
    im = plot(im, ypxl1 + 1, xpxl1, fpart(yend) * xgap)
    return im

  def false_fun(im):
    im = plot(im, xpxl1, ypxl1, rfpart(yend) * xgap)
    im = plot(im, xpxl1, ypxl1 + 1, fpart(yend) * xgap)
    return im

  im = tf.cond(steep, lambda: true_fun(im), lambda: false_fun(im))

  intery = yend + gradient

  # handle second endpoint
  xend = round_(x1)
  yend = y1 + gradient * (as_float(xend) - x1)
  xgap = fpart(x1 + 0.5)
  xpxl2 = xend  # this will be used in the main loop
  ypxl2 = ipart(yend)

  def true_fun(im):  # pylint: disable=function-redefined
    im = plot(im, ypxl2, xpxl2, rfpart(yend) * xgap)
    im = plot(im, ypxl2 + 1, xpxl2, fpart(yend) * xgap)
    return im

  def false_fun(im):  # pylint: disable=function-redefined
    im = plot(im, xpxl2, ypxl2, rfpart(yend) * xgap)
    im = plot(im, xpxl2, ypxl2 + 1, fpart(yend) * xgap)
    return im

  im = tf.cond(steep, lambda: true_fun(im), lambda: false_fun(im))

  def fori_loop(lower, upper, body_fun, init_val):
    # lax.fori_loop with traced bounds: a while_loop over (i, upper, x).
    return tf.while_loop(lambda i, x: i < upper,
                         lambda i, x: (i + 1, body_fun(i, x)),
                         (lower, init_val))[1]

  def true_fun(arg):  # pylint: disable=function-redefined
    im, intery = arg

    def body_fun(x, arg):
      im, intery = arg
      im = plot(im, ipart(intery), x, rfpart(intery))
      im = plot(im, ipart(intery) + 1, x, fpart(intery))
      intery = intery + gradient
      return (im, intery)

    im, intery = fori_loop(xpxl1 + 1, xpxl2, body_fun, (im, intery))
    return (im, intery)

  def false_fun(arg):  # pylint: disable=function-redefined
    im, intery = arg

    def body_fun(x, arg):
      im, intery = arg
      im = plot(im, x, ipart(intery), rfpart(intery))
      im = plot(im, x, ipart(intery) + 1, fpart(intery))
      intery = intery + gradient
      return (im, intery)

    im, intery = fori_loop(xpxl1 + 1, xpxl2, body_fun, (im, intery))
    return (im, intery)

  im, intery = tf.cond(steep, lambda: true_fun((im, intery)),
                       lambda: false_fun((im, intery)))

  return im


@tf.function
def f(state, t):
  del t  # unused, as in the notebook
  x, y, z = tf.unstack(state)
  return tf.stack([sigma * (y - x), x * (rho - z) - y, x * y - beta * z])


@tf.function
def rk4(ys, dt, N):  # pylint: disable=invalid-name

  @tf.function
  def step(i, ys):
    h = dt
    t = dt * tf.cast(i, tf.float32)
    k1 = h * f(ys[i - 1], t)
    k2 = h * f(ys[i - 1] + k1 / 2., dt * tf.cast(i, tf.float32) + h / 2.)
    k3 = h * f(ys[i - 1] + k2 / 2., t + h / 2.)
    k4 = h * f(ys[i - 1] + k3, t + h)

    ysi = ys[i - 1] + 1. / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
    return tf.tensor_scatter_nd_update(ys, [[i]], ysi[None])

  # lax.fori_loop(1, N, step, ys) with a traced N.
  return tf.while_loop(lambda i, ys: i < N,
                       lambda i, ys: (i + 1, step(i, ys)),
                       (tf.constant(1), ys))[1]


def solve():
  """The notebook's cell that solves each replicate with `pmap` of rk4."""
  ys = np.zeros((N_DEV, N, 3), np.float32)
  ys[:, 0] = initial_states()
  return tfspmd.pmap(rk4)(ys, DT * np.ones(N_DEV, np.float32),
                          N * np.ones(N_DEV, dtype=np.int32))


# parallel plotter using lexical closure and pmap'd core plotting function
def pplotter(_xs, _zs, xlim, zlim, xN, zN):  # pylint: disable=invalid-name
  N_dev = _xs.shape[0]  # pylint: disable=invalid-name
  im = tf.zeros((N_dev, xN, zN))

  @tfspmd.pmap
  def plotfn(im, xs, zs):
    xpixels = (xs - xlim[0]) / (1.0 * (xlim[1] - xlim[0])) * xN
    zpixels = (zs - zlim[0]) / (1.0 * (zlim[1] - zlim[0])) * zN

    def body_fun(i, im):
      return drawline(im, xpixels[i - 1], zpixels[i - 1], xpixels[i],
                      zpixels[i])

    # lax.fori_loop(1, xpixels.shape[0], body_fun, im): static bounds.
    return tf.while_loop(lambda i, im: i < xpixels.shape[0],
                         lambda i, im: (i + 1, body_fun(i, im)),
                         (tf.constant(1), im))[1]

  return plotfn(im, _xs, _zs)


def main():
  ys = np.asarray(solve())
  ims = np.asarray(pplotter(ys[..., 0], ys[..., 2], XLIM, ZLIM, XN, ZN))
  print("last states:\n", np.round(ys[:, -1], 3))
  print("ink per image:", np.round(ims.sum(axis=(1, 2)), 3))


if __name__ == "__main__":
  main()
