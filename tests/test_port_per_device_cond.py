"""The Lorentz ODE Solver colab's pmaps, ported from JAX, against JAX.

The program is JAX's Cloud TPU colab "Lorentz ODE Solver" by Alex Alemi
(github.com/jax-ml/jax, cloud_tpu_colabs/Lorentz_ODE_Solver.ipynb, as of
commit cec06d116c05f0d52adfceee3d3b730fdbcb0ce5; the notebook last changed in
ee6cce5601fe1a81cec914bf50f3cbd9a72d69b1), its section "Parallel ODE Solutions
with Pmap":

* `jax.pmap(rk4)` integrates the Lorenz system from a different initial state
  on every device: a `lax.fori_loop` whose trip count `N` is a mapped
  argument, writing row i of the trajectory at a traced index;
* `pplotter` draws each device's trajectory into that device's image with
  `drawline`, Wu's antialiased line algorithm: a `lax.fori_loop` over the
  segments, and in each segment `lax.cond`s on per-device data (is the
  segment steep? is it drawn right to left?) choosing which pixels the
  endpoints light, and a `lax.cond` whose two branches each run a
  `lax.fori_loop` between per-device pixel bounds (`xpxl1 + 1` to `xpxl2`,
  empty on some devices). Every device takes its own branches and runs its
  own number of inner iterations.

The port (examples/lorenz_ode.py) goes line by line: `tf` ops for `jnp`, `tf.cond` for `lax.cond`, a
`tf.while_loop` for each `lax.fori_loop` (JAX's own lowering of a fori_loop
with traced bounds), `tf.function` for `jit`, `tf.tensor_scatter_nd_add` /
`_update` for `.at[...].add` / `.set`, and the explicit casts TensorFlow
needs where JAX promotes int32 to float32. The notebook spells the indexed
updates with `jax.ops.index_add` / `index_update` and `lax.cond` with its
old five-argument form, both removed from JAX since; the JAX run that gave
the numbers below spells them `.at[...].add` / `.set` and `lax.cond(pred,
true_fun, false_fun, operand)`, which mean the same. The initial states
come from `np.random.default_rng(0)` instead of `jax.random`, and the sizes
are small (100 steps, images of 40 x 30 pixels, against 4000 steps and 200 x
150 in the notebook); the plotting limits are the notebook's. With these
inputs every pixel the lines touch lies inside the image, so the scatter's
handling of indices out of range (JAX drops them) does not come in.
"""


import numpy as np

from examples.lorenz_ode import DT, N, N_DEV, XLIM, XN, ZLIM, ZN
from examples.lorenz_ode import beta, rho, sigma
from examples.lorenz_ode import initial_states, pplotter, solve

# JAX 0.10.2 printed these on 8 CPU devices (XLA_FLAGS=
# --xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu) for the program
# in the module docstring with the inputs above.
JAX_YS_LAST = [
    [-14.707700729370117, -3.933699607849121, 43.86421585083008],
    [-5.747547149658203, 4.637629508972168, 34.53059005737305],
    [2.1524534225463867, -3.664600372314453, 28.836366653442383],
    [-2.930206298828125, -5.418240070343018, 22.586952209472656],
    [-14.150954246520996, -0.575886607170105, 44.83963394165039],
    [13.203102111816406, 23.776378631591797, 17.78053855895996],
    [-3.4202961921691895, 3.6866116523742676, 30.60087013244629],
    [-5.856058597564697, 3.4827892780303955, 33.8434944152832]]
JAX_YS_SUM = [-311.21002197265625, 263.53424072265625, 4713.2958984375,
              4386.763671875, -428.99932861328125, 1618.192626953125,
              591.0932006835938, 336.4557189941406]
JAX_IMS_SUM = [99.68609619140625, 99.22219848632812, 97.95857238769531,
               97.75341796875, 98.58563232421875, 97.7551040649414,
               99.46978759765625, 97.92110443115234]
JAX_IMS_NONZERO = [75, 86, 73, 86, 98, 55, 68, 76]
# sum(im * row index) and sum(im * column index) of each device's image.
JAX_IMS_ROW_MOMENT = [1202.512669735821, 794.9523227345198,
                      2947.9058609278873, 2845.1932301060297,
                      1245.1083902865648, 2136.5652409158647,
                      927.7879879674874, 830.6797214192338]
JAX_IMS_COL_MOMENT = [1048.2643006672151, 1392.5415083542466,
                      1614.2534825615585, 1778.84310832154,
                      1010.6551987342536, 343.94202141463757,
                      1549.4843737687916, 1436.38269613171]
JAX_IMS_SQ = [261.3127136230469, 244.56027221679688, 209.41522216796875,
              201.90646362304688, 162.97280883789062, 367.21795654296875,
              360.1256103515625, 246.5594482421875]


# ---------------------------------------------------------------------------
# A NumPy reference, written from the algorithm (float64).
# ---------------------------------------------------------------------------


def numpy_rk4(state0, dt, n):
  def f_np(s):
    x, y, z = s
    return np.array([sigma * (y - x), x * (rho - z) - y, x * y - beta * z])

  ys = np.zeros((n, 3))
  ys[0] = state0
  for i in range(1, n):
    k1 = dt * f_np(ys[i - 1])
    k2 = dt * f_np(ys[i - 1] + k1 / 2)
    k3 = dt * f_np(ys[i - 1] + k2 / 2)
    k4 = dt * f_np(ys[i - 1] + k3)
    ys[i] = ys[i - 1] + (k1 + 2 * k2 + 2 * k3 + k4) / 6
  return ys


def numpy_drawline(im, x0, y0, x1, y1):
  """Wu's algorithm as the notebook writes it, in plain Python."""
  ipart = lambda x: int(np.floor(x))
  fpart = lambda x: x - np.floor(x)
  rfpart = lambda x: 1 - fpart(x)

  def plot(x, y, c):
    assert 0 <= x < im.shape[0] and 0 <= y < im.shape[1], (x, y)
    im[x, y] += c

  steep = abs(y1 - y0) > abs(x1 - x0)
  if steep:
    x0, y0, x1, y1 = y0, x0, y1, x1
  if x0 > x1:
    x0, x1, y0, y1 = x1, x0, y1, y0
  dx, dy = x1 - x0, y1 - y0
  gradient = 1.0 if dx == 0.0 else dy / dx
  pixels = []
  for x_end, y_end_of, gap in ((x0, y0, rfpart(x0 + 0.5)),
                               (x1, y1, fpart(x1 + 0.5))):
    xend = ipart(x_end + 0.5)
    yend = y_end_of + gradient * (xend - x_end)
    pixels.append((xend, yend, gap))
  (xpxl1, yend1, gap1), (xpxl2, yend2, gap2) = pixels
  for xpxl, yend, gap in ((xpxl1, yend1, gap1), (xpxl2, yend2, gap2)):
    if steep:
      plot(ipart(yend), xpxl, rfpart(yend) * gap)
      plot(ipart(yend) + 1, xpxl, fpart(yend) * gap)
    else:
      plot(xpxl, ipart(yend), rfpart(yend) * gap)
      plot(xpxl, ipart(yend) + 1, fpart(yend) * gap)
  intery = yend1 + gradient
  for x in range(xpxl1 + 1, xpxl2):
    if steep:
      plot(ipart(intery), x, rfpart(intery))
      plot(ipart(intery) + 1, x, fpart(intery))
    else:
      plot(x, ipart(intery), rfpart(intery))
      plot(x, ipart(intery) + 1, fpart(intery))
    intery += gradient


def numpy_images(ys):
  ims = np.zeros((len(ys), XN, ZN))
  for d, trajectory in enumerate(ys):
    xp = (trajectory[:, 0] - XLIM[0]) / (XLIM[1] - XLIM[0]) * XN
    zp = (trajectory[:, 2] - ZLIM[0]) / (ZLIM[1] - ZLIM[0]) * ZN
    for i in range(1, len(trajectory)):
      numpy_drawline(ims[d], xp[i - 1], zp[i - 1], xp[i], zp[i])
  return ims


def image_statistics(ims):
  rows = np.arange(XN)[:, None]
  cols = np.arange(ZN)[None, :]
  return dict(sum=ims.sum(axis=(1, 2)),
              nonzero=(ims != 0).sum(axis=(1, 2)),
              row_moment=(ims * rows).sum(axis=(1, 2)),
              col_moment=(ims * cols).sum(axis=(1, 2)),
              sq=(ims ** 2).sum(axis=(1, 2)))


def check_images(ims):
  # The images depend on floor() of the trajectories: tfspmd's trajectories
  # agree with JAX's to 1e-5 (absolute) and the float64 reference's to 3e-5,
  # and give the same pixels; random relative changes of 1e-6 to the
  # trajectories move a pixel in about one try in five.
  stats = image_statistics(ims)
  np.testing.assert_allclose(stats["sum"], JAX_IMS_SUM, rtol=1e-4)
  np.testing.assert_array_equal(stats["nonzero"], JAX_IMS_NONZERO)
  np.testing.assert_allclose(stats["row_moment"], JAX_IMS_ROW_MOMENT,
                             rtol=1e-4)
  np.testing.assert_allclose(stats["col_moment"], JAX_IMS_COL_MOMENT,
                             rtol=1e-4)
  np.testing.assert_allclose(stats["sq"], JAX_IMS_SQ, rtol=1e-4)


# ---------------------------------------------------------------------------
# Tests.
# ---------------------------------------------------------------------------


def test_numpy_reference_reproduces_jax_numbers():
  ys = np.stack([numpy_rk4(s, DT, N) for s in initial_states()])
  np.testing.assert_allclose(ys[:, -1], JAX_YS_LAST, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(ys.sum(axis=(1, 2)), JAX_YS_SUM, rtol=1e-4)
  check_images(numpy_images(ys))


def test_pmap_of_rk4_with_a_mapped_trip_count():
  ys = np.asarray(solve())
  assert ys.shape == (N_DEV, N, 3)
  np.testing.assert_allclose(ys[:, -1], JAX_YS_LAST, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(ys.sum(axis=(1, 2)), JAX_YS_SUM, rtol=1e-4)
  want = np.stack([numpy_rk4(s, DT, N) for s in initial_states()])
  np.testing.assert_allclose(ys, want, rtol=1e-4, atol=1e-4)


def test_pplotter_draws_each_trajectory_with_per_device_conds_and_loops():
  ys = np.asarray(solve())
  ims = np.asarray(pplotter(ys[..., 0], ys[..., 2], XLIM, ZLIM, XN, ZN))
  assert ims.shape == (N_DEV, XN, ZN)
  check_images(ims)
  # Pixel by pixel against the NumPy drawing of the same trajectories.
  np.testing.assert_allclose(ims, numpy_images(ys.astype(np.float64)),
                             rtol=1e-4, atol=1e-5)
  # The devices took different branches: some segments are steep, some are
  # drawn right to left, and the inner loops ran different trip counts.
  xp = (ys[..., 0] - XLIM[0]) / (XLIM[1] - XLIM[0]) * XN
  zp = (ys[..., 2] - ZLIM[0]) / (ZLIM[1] - ZLIM[0]) * ZN
  steep = np.abs(np.diff(zp, axis=1)) > np.abs(np.diff(xp, axis=1))
  backwards = np.where(steep, np.diff(zp, axis=1), np.diff(xp, axis=1)) < 0
  assert (steep.any(axis=0) & ~steep.all(axis=0)).any()
  assert (backwards.any(axis=0) & ~backwards.all(axis=0)).any()
