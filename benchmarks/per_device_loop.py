"""Per-device control flow against JAX: the Lorenz ODE colab's two pmaps.

`examples/lorenz_ode.py` is the colab's "Parallel ODE Solutions with Pmap"
in TensorFlow; the same program in JAX is written here from the notebook.
Both run on 8 CPU devices in one process, with the same inputs:

  solve       `pmap(rk4)(ys, dt, N)`: a loop whose trip count is a mapped
              argument, a row of the trajectory written at a traced index
              each pass; `pmap(rk4)` is written in each call, as the
              notebook does
  plot        a pmap (made once) of the plotting loop: 99 segments, each
              with per-device `cond`s and inner loops between per-device
              pixel bounds, scatters of one pixel each
  pplotter    the notebook's `pplotter`, which makes a new pmap of a new
              closure on every call: trace, compile and run each time

tfspmd runs each on both executors: the host's one XLA program (the
default on CPU devices) and DTensor's ("dtensor" rows' columns).

Each call waits for its values (fetched to NumPy). Steady calls are
interleaved rounds (medians); first calls are the first of each in this
process, after one untimed call of an unrelated small pmap per framework.

Run: python -m benchmarks.per_device_loop [--rounds N]
(needs the `benchmarks` extra: jax and jaxlib)
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import timing  # pylint: disable=wrong-import-position

timing.same_cpu_devices_for_jax()

import numpy as np  # pylint: disable=wrong-import-position
import tensorflow as tf  # pylint: disable=wrong-import-position

import tfspmd  # pylint: disable=wrong-import-position
from examples import lorenz_ode  # pylint: disable=wrong-import-position

import jax  # pylint: disable=wrong-import-position,g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=wrong-import-position
from jax import lax  # pylint: disable=wrong-import-position

XLIM, ZLIM, XN, ZN = lorenz_ode.XLIM, lorenz_ode.ZLIM, lorenz_ode.XN, lorenz_ode.ZN


# --- The notebook's program in JAX -------------------------------------------


@jax.jit
def jax_drawline(im, x0, y0, x1, y1):
  """Wu's antialiased line algorithm, as the notebook writes it."""
  ipart = lambda x: jnp.floor(x).astype(jnp.int32)
  round_ = lambda x: ipart(x + 0.5)
  fpart = lambda x: x - jnp.floor(x)
  rfpart = lambda x: 1 - fpart(x)

  def plot(im, x, y, c):
    return im.at[x, y].add(c)

  steep = jnp.abs(y1 - y0) > jnp.abs(x1 - x0)
  cond_swap = lambda cond, x: lax.cond(cond, lambda x: (x[1], x[0]),
                                       lambda x: x, x)
  (x0, y0) = cond_swap(steep, (x0, y0))
  (x1, y1) = cond_swap(steep, (x1, y1))
  (y0, y1) = cond_swap(x0 > x1, (y0, y1))
  (x0, x1) = cond_swap(x0 > x1, (x0, x1))
  dx, dy = x1 - x0, y1 - y0
  gradient = jnp.where(dx == 0.0, 1.0, dy / dx)

  def endpoint(im, x, y, gap_of):
    xend = round_(x)
    yend = y + gradient * (xend - x)
    xgap = gap_of(x + 0.5)
    ypxl = ipart(yend)

    def steep_plot(im):
      im = plot(im, ypxl, xend, rfpart(yend) * xgap)
      return plot(im, ypxl + 1, xend, fpart(yend) * xgap)

    def flat_plot(im):
      im = plot(im, xend, ypxl, rfpart(yend) * xgap)
      return plot(im, xend, ypxl + 1, fpart(yend) * xgap)

    return lax.cond(steep, steep_plot, flat_plot, im), xend, yend

  im, xpxl1, yend1 = endpoint(im, x0, y0, rfpart)
  im, xpxl2, _ = endpoint(im, x1, y1, fpart)
  intery = yend1 + gradient

  def run(swap):
    def body_fun(x, arg):
      im, intery = arg
      first, second = (ipart(intery), x) if swap else (x, ipart(intery))
      im = plot(im, first, second, rfpart(intery))
      first, second = ((ipart(intery) + 1, x) if swap else
                       (x, ipart(intery) + 1))
      im = plot(im, first, second, fpart(intery))
      return im, intery + gradient
    return lambda arg: lax.fori_loop(xpxl1 + 1, xpxl2, body_fun, arg)

  im, _ = lax.cond(steep, run(True), run(False), (im, intery))
  return im


@jax.jit
def jax_f(state, t):
  del t
  x, y, z = state
  return jnp.array([lorenz_ode.sigma * (y - x),
                    x * (lorenz_ode.rho - z) - y,
                    x * y - lorenz_ode.beta * z])


@jax.jit
def jax_rk4(ys, dt, n):
  @jax.jit
  def step(i, ys):
    h = dt
    t = dt * i
    k1 = h * jax_f(ys[i - 1], t)
    k2 = h * jax_f(ys[i - 1] + k1 / 2., dt * i + h / 2.)
    k3 = h * jax_f(ys[i - 1] + k2 / 2., t + h / 2.)
    k4 = h * jax_f(ys[i - 1] + k3, t + h)
    return ys.at[i].set(ys[i - 1] + 1. / 6 * (k1 + 2 * k2 + 2 * k3 + k4))
  return lax.fori_loop(1, n, step, ys)


def _start():
  ys = np.zeros((lorenz_ode.N_DEV, lorenz_ode.N, 3), np.float32)
  ys[:, 0] = lorenz_ode.initial_states()
  return (ys, lorenz_ode.DT * np.ones(lorenz_ode.N_DEV, np.float32),
          lorenz_ode.N * np.ones(lorenz_ode.N_DEV, np.int32))


def jax_solve():
  return jax.pmap(jax_rk4)(*_start())


def jax_plotfn(drawline):
  def plotfn(im, xs, zs):
    xpixels = (xs - XLIM[0]) / (1.0 * (XLIM[1] - XLIM[0])) * XN
    zpixels = (zs - ZLIM[0]) / (1.0 * (ZLIM[1] - ZLIM[0])) * ZN
    return lax.fori_loop(1, xpixels.shape[0], lambda i, im: drawline(
        im, xpixels[i - 1], zpixels[i - 1], xpixels[i], zpixels[i]), im)
  return plotfn


def jax_pplotter(xs, zs):
  return jax.pmap(jax_plotfn(jax_drawline))(
      jnp.zeros((xs.shape[0], XN, ZN)), xs, zs)


# --- tfspmd's plotting pmap, made once -----------------------------------------


def tfspmd_plotfn():
  def plotfn(im, xs, zs):
    xpixels = (xs - XLIM[0]) / (1.0 * (XLIM[1] - XLIM[0])) * XN
    zpixels = (zs - ZLIM[0]) / (1.0 * (ZLIM[1] - ZLIM[0])) * ZN
    return tf.while_loop(
        lambda i, im: i < xpixels.shape[0],
        lambda i, im: (i + 1, lorenz_ode.drawline(
            im, xpixels[i - 1], zpixels[i - 1], xpixels[i], zpixels[i])),
        (tf.constant(1), im))[1]
  return tfspmd.pmap(plotfn)


def _seconds(function):
  start = time.perf_counter()
  out = np.asarray(function())
  return time.perf_counter() - start, out


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=5)
  options = parser.parse_args()

  for warm in (lambda: tfspmd.pmap(lambda v: v * 2.)(np.ones(8, np.float32)),
               lambda: jax.pmap(lambda v: v * 2.)(np.ones(8, np.float32))):
    np.asarray(warm())

  on_dtensor = lambda function: timing.on_executor("dtensor", function)
  first = {}
  first["tfspmd solve"], ys = _seconds(lorenz_ode.solve)
  first["dtensor solve"], dtensor_ys = _seconds(on_dtensor(lorenz_ode.solve))
  np.testing.assert_allclose(ys, dtensor_ys, rtol=1e-4, atol=1e-4)
  first["jax solve"], jax_ys = _seconds(jax_solve)
  np.testing.assert_allclose(ys, jax_ys, rtol=1e-4, atol=1e-4)
  xs, zs = np.ascontiguousarray(ys[..., 0]), np.ascontiguousarray(ys[..., 2])
  first["tfspmd pplotter"], ims = _seconds(
      lambda: lorenz_ode.pplotter(xs, zs, XLIM, ZLIM, XN, ZN))
  first["dtensor pplotter"], dtensor_ims = _seconds(on_dtensor(
      lambda: lorenz_ode.pplotter(xs, zs, XLIM, ZLIM, XN, ZN)))
  first["jax pplotter"], jax_ims = _seconds(lambda: jax_pplotter(xs, zs))
  np.testing.assert_allclose(ims, jax_ims, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(dtensor_ims, jax_ims, rtol=1e-4, atol=1e-4)

  image = np.zeros((lorenz_ode.N_DEV, XN, ZN), np.float32)
  tfspmd_plot, jax_plot = tfspmd_plotfn(), jax.pmap(jax_plotfn(jax_drawline))
  fetched = lambda function: lambda: np.asarray(function())
  samples = timing.interleaved({
      "tfspmd solve": fetched(lorenz_ode.solve),
      "dtensor solve": fetched(on_dtensor(lorenz_ode.solve)),
      "jax solve": fetched(jax_solve),
      "tfspmd plot": fetched(lambda: tfspmd_plot(image, xs, zs)),
      "dtensor plot": fetched(on_dtensor(lambda: tfspmd_plot(image, xs, zs))),
      "jax plot": fetched(lambda: jax_plot(image, xs, zs)),
  }, rounds=options.rounds, calls_per_round=3, warmup=2)
  samples.update(timing.interleaved({
      "tfspmd pplotter": fetched(
          lambda: lorenz_ode.pplotter(xs, zs, XLIM, ZLIM, XN, ZN)),
      "dtensor pplotter": fetched(on_dtensor(
          lambda: lorenz_ode.pplotter(xs, zs, XLIM, ZLIM, XN, ZN))),
      "jax pplotter": fetched(lambda: jax_pplotter(xs, zs)),
  }, rounds=options.rounds, calls_per_round=1, warmup=0))
  summary = timing.summarize(samples)

  rows = []
  for program in ("solve", "plot", "pplotter"):
    ours = summary[f"tfspmd {program}"]["median_us"] / 1e3
    theirs = summary[f"jax {program}"]["median_us"] / 1e3
    dtensor = summary[f"dtensor {program}"]["median_us"] / 1e3
    row = dict(program=program, tfspmd_ms=ours, dtensor_ms=dtensor,
               jax_ms=theirs, tfspmd_over_jax=ours / theirs,
               dtensor_over_jax=dtensor / theirs)
    if f"tfspmd {program}" in first:
      row.update(tfspmd_first_s=first[f"tfspmd {program}"],
                 dtensor_first_s=first[f"dtensor {program}"],
                 jax_first_s=first[f"jax {program}"])
    rows.append(row)
  timing.print_table(
      "The Lorenz colab's pmaps on 8 CPU devices: median ms a call (values "
      "fetched), and the first call's seconds", rows,
      ["program", "tfspmd_ms", "dtensor_ms", "jax_ms", "tfspmd_over_jax",
       "dtensor_over_jax", "tfspmd_first_s", "dtensor_first_s", "jax_first_s"])
  path = timing.write_results("per_device_loop", dict(
      machine=timing.machine(), rows=rows, results=summary, first_s=first,
      load_average=os.getloadavg()))
  print(f"\nwrote {path}")


if __name__ == "__main__":
  main()
