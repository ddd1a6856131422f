"""tfspmd side by side with jax.pmap and tf.distribute.MirroredStrategy.

One command runs every section, prints a table per section and writes
`benchmarks/results/compare_<section>.json`. Every figure is a median of
repeated calls with the contenders interleaved round by round in this one
process (8 logical CPU devices for TensorFlow, 8 host devices for JAX), and
every timed call waits for its result.

Sections:
  dispatch    per-call cost of x + 1 on device-resident input
  roundtrip   psum from host arrays to host arrays
  bandwidth   psum, all_gather, psum_scatter, ppermute, all_to_all at 4 KiB,
              1 MiB and 64 MiB per device: bus bandwidth (NCCL-tests'
              definition) against jax and this machine's memcpy
  training    data-parallel MLP and conv-net steps, examples per second, at
              K = 1, 10 and 100 steps per call, on both executors; beside jax and
              MirroredStrategy, the same steps written directly in DTensor
  compile     first two calls (trace + compile + run) of the MLP and conv
              steps, each in fresh processes taking turns
  memory      host RSS while placing a 1 GiB mapped input and reading the
              result back (a child process per contender)
  scaling     MLP step time at 1, 2, 4, 8 devices, fixed work per device

Run: python benchmarks/compare.py [--only SECTION ...] [--quick]
(needs the `benchmarks` extra: jax and jaxlib)
"""

import argparse
import functools
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import timing  # pylint: disable=wrong-import-position

timing.same_cpu_devices_for_jax()

import numpy as np  # pylint: disable=wrong-import-position
import tensorflow as tf  # pylint: disable=wrong-import-position
from tensorflow.experimental import dtensor  # pylint: disable=wrong-import-position

import tfspmd  # pylint: disable=wrong-import-position
from tfspmd import lax  # pylint: disable=wrong-import-position
from tfspmd._src.core import tf_internal  # pylint: disable=wrong-import-position

import jax  # pylint: disable=wrong-import-position,g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=wrong-import-position

AXIS = "i"
FEATURES, HIDDEN, CLASSES, PER_DEVICE_BATCH = 64, 128, 10, 32


def _blocking(function):
  """Calls `function` and waits for every array it returns."""
  def call():
    out = function()
    for leaf in jax.tree_util.tree_leaves(out):
      if hasattr(leaf, "block_until_ready"):
        leaf.block_until_ready()
    # TensorFlow's eager calls may return before the devices finish.
    tf_internal.wait_for_pending_ops()
    return out
  return call


def _mirrored(count):
  return tf.distribute.MirroredStrategy(
      [f"/job:localhost/replica:0/task:0/device:CPU:{k}" for k in range(count)],
      cross_device_ops=tf.distribute.ReductionToOneDevice())


def _per_replica(strategy, array):
  return strategy.experimental_distribute_values_from_function(
      lambda context: tf.constant(array[context.replica_id_in_sync_group]))


def _ratios(summary, base):
  return {name: stats["median_us"] / summary[base]["median_us"]
          for name, stats in summary.items()}


def _report(section, title, summary, base, extra=None):
  ratios = _ratios(summary, base)
  rows = [dict(name=name, median_us=stats["median_us"], p90_us=stats["p90_us"],
               ratio=ratios[name]) for name, stats in summary.items()]
  timing.print_table(f"{title} (ratio to {base})", rows,
                     ["name", "median_us", "p90_us", "ratio"])
  timing.write_results(f"compare_{section}", dict(
      machine=timing.machine(), title=title, base=base, results=summary,
      ratios=ratios, load_average=os.getloadavg(), **(extra or {})))


# --- 1. dispatch ------------------------------------------------------------

def dispatch(count, options):
  x = np.zeros((count, 16), np.float32)
  step = tfspmd.pmap(lambda v: v + 1.0)
  state = {"tfspmd": step(x)}
  on_dtensor = timing.on_executor("dtensor", lambda: step(x))
  state["tfspmd dtensor"] = on_dtensor()
  layout = state["tfspmd dtensor"].layout
  raw_input = dtensor.pack([tf.zeros((1, 16))] * count, layout)
  raw = tf.function(lambda v: v + 1.0, jit_compile=True)
  jax_step = jax.pmap(lambda v: v + 1.0)
  state["jax"] = jax_step(x)
  strategy = _mirrored(count)
  mirrored_step = tf.function(lambda v: strategy.run(lambda t: t + 1.0, args=(v,)))
  state["mirrored"] = mirrored_step(_per_replica(strategy, x))

  def tfspmd_call():
    state["tfspmd"] = step(state["tfspmd"])
    return state["tfspmd"]

  def tfspmd_dtensor_call():
    state["tfspmd dtensor"] = step(state["tfspmd dtensor"])
    return state["tfspmd dtensor"]

  def jax_call():
    state["jax"] = jax_step(state["jax"])
    return state["jax"]

  def mirrored_call():
    state["mirrored"] = mirrored_step(state["mirrored"])
    return strategy.experimental_local_results(state["mirrored"])

  contenders = {"raw DTensor jit call": _blocking(lambda: raw(raw_input)),
                "tfspmd.pmap": _blocking(tfspmd_call),
                "tfspmd.pmap, DTensor executor": _blocking(
                    timing.on_executor("dtensor", tfspmd_dtensor_call)),
                "jax.pmap": _blocking(jax_call),
                "MirroredStrategy.run": _blocking(mirrored_call)}
  summary = timing.summarize(timing.interleaved(
      contenders, rounds=options.rounds, calls_per_round=options.calls))
  _report("dispatch", f"Per-call cost of x + 1 on {count} devices, input on the "
          f"devices", summary, "raw DTensor jit call")


# --- 2. psum round trip -----------------------------------------------------

def roundtrip(count, options):
  x = np.random.default_rng(0).standard_normal((count, 256)).astype(np.float32)
  expected = np.broadcast_to(x.sum(0), x.shape)
  ours = tfspmd.pmap(lambda v: lax.psum(v, AXIS), AXIS)
  theirs = jax.pmap(lambda v: jax.lax.psum(v, AXIS), AXIS)
  strategy = _mirrored(count)

  @tf.function
  def mirrored_psum(v):
    return strategy.run(lambda t: tf.distribute.get_replica_context().all_reduce(
        "sum", t), args=(v,))

  def mirrored_call():
    out = mirrored_psum(_per_replica(strategy, x))
    return np.stack([t.numpy() for t in strategy.experimental_local_results(out)])

  contenders = {"tfspmd.pmap": lambda: np.asarray(ours(x)),
                "tfspmd.pmap, DTensor executor": timing.on_executor(
                    "dtensor", lambda: np.asarray(ours(x))),
                "jax.pmap": lambda: np.asarray(theirs(x)),
                "MirroredStrategy": mirrored_call}
  for name, call in contenders.items():
    np.testing.assert_allclose(call(), expected, rtol=1e-5, err_msg=name)
  summary = timing.summarize(timing.interleaved(
      contenders, rounds=options.rounds, calls_per_round=options.calls))
  _report("roundtrip", f"psum of 1 KiB per device, NumPy in and out, {count} "
          f"devices", summary, "tfspmd.pmap")


# --- 3. bandwidth -----------------------------------------------------------

# (name, tfspmd fn, jax fn, largest size, busbw factor, how many per-device
#  inputs NCCL-tests counts as the data size S: n for all-gather's output)
def _collectives(count):
  ring = [(k, (k + 1) % count) for k in range(count)]
  factor = (count - 1) / count
  return [
      ("psum", lambda v: lax.psum(v, AXIS), lambda v: jax.lax.psum(v, AXIS),
       64 << 20, 2 * factor, 1),
      ("all_gather", lambda v: lax.all_gather(v, AXIS, tiled=True),
       lambda v: jax.lax.all_gather(v, AXIS, tiled=True), 16 << 20, factor,
       count),
      ("psum_scatter", lambda v: lax.psum_scatter(v, AXIS, tiled=True),
       lambda v: jax.lax.psum_scatter(v, AXIS, tiled=True), 64 << 20, factor,
       1),
      ("ppermute", lambda v: lax.ppermute(v, AXIS, ring),
       lambda v: jax.lax.ppermute(v, AXIS, ring), 16 << 20, 1.0, 1),
      ("all_to_all", lambda v: lax.all_to_all(v, AXIS, 0, 0, tiled=True),
       lambda v: jax.lax.all_to_all(v, AXIS, 0, 0, tiled=True), 64 << 20,
       factor, 1),
  ]


def _memcpy_gbps(nbytes):
  source = np.ones(nbytes // 4, np.float32)
  target = np.empty_like(source)
  times = []
  for _ in range(7):
    start = time.perf_counter()
    np.copyto(target, source)
    times.append(time.perf_counter() - start)
  return nbytes / sorted(times)[3] / 1e9


def bandwidth(count, options):
  """Bus bandwidth per collective and size.

  all_gather stops at 16 MiB: its result is n times its input on each of
  the n devices (4 GiB at 64 MiB on 8 devices), more than this 24 GiB
  machine can give next to JAX's and the other jobs'. ppermute stops there
  too, to keep the section short.
  """
  sizes = [("4 KiB", 4 << 10), ("1 MiB", 1 << 20), ("16 MiB", 16 << 20),
           ("64 MiB", 64 << 20)]
  if options.quick:
    sizes = sizes[:2]
  rows, results = [], {}
  memcpy = _memcpy_gbps(64 << 20)
  for name, ours_fn, jax_fn, largest, bus_factor, counted in _collectives(count):
    for label, nbytes in sizes:
      if nbytes > largest:
        continue
      x = np.ones((count, nbytes // 4), np.float32)
      ours = tfspmd.pmap(ours_fn, AXIS)
      placed = tfspmd.pmap(lambda v: v, AXIS)(x)
      placed_dtensor = timing.on_executor(
          "dtensor", lambda: tfspmd.pmap(lambda v: v, AXIS)(x))()
      theirs = jax.pmap(jax_fn, AXIS)
      jax_placed = jax.pmap(lambda v: v, AXIS)(x)
      contenders = {"tfspmd": _blocking(lambda: ours(placed)),
                    "tfspmd dtensor": _blocking(timing.on_executor(
                        "dtensor", lambda: ours(placed_dtensor))),
                    "jax": _blocking(lambda: theirs(jax_placed))}
      calls = max(1, min(options.calls, options.calls * (1 << 20) // nbytes))
      summary = timing.summarize(timing.interleaved(
          contenders, rounds=options.rounds, calls_per_round=calls,
          warmup=min(calls, 3)))
      counted_bytes = nbytes * counted
      for who, stats in summary.items():
        seconds = stats["median_us"] * 1e-6
        busbw = counted_bytes / seconds * bus_factor / 1e9
        results.setdefault(name, {}).setdefault(label, {})[who] = dict(
            stats, busbw_gbps=busbw)
      ours_bw = results[name][label]["tfspmd"]["busbw_gbps"]
      jax_bw = results[name][label]["jax"]["busbw_gbps"]
      rows.append(dict(collective=name, size=label,
                       tfspmd_us=summary["tfspmd"]["median_us"],
                       dtensor_executor_us=summary["tfspmd dtensor"][
                           "median_us"],
                       jax_us=summary["jax"]["median_us"],
                       tfspmd_busbw_GBps=ours_bw, jax_busbw_GBps=jax_bw,
                       tfspmd_over_jax=ours_bw / jax_bw,
                       tfspmd_over_memcpy=ours_bw / memcpy))
  timing.print_table(
      f"Collective bus bandwidth, {count} devices (memcpy {memcpy:.1f} GB/s)",
      rows, ["collective", "size", "tfspmd_us", "dtensor_executor_us",
             "jax_us", "tfspmd_busbw_GBps",
             "jax_busbw_GBps", "tfspmd_over_jax", "tfspmd_over_memcpy"])
  timing.write_results("compare_bandwidth", dict(
      machine=timing.machine(), memcpy_gbps=memcpy, results=results,
      rows=rows, load_average=os.getloadavg()))


# --- 4. training, 5. compile, 7. scaling ------------------------------------

def _init_mlp(seed=0):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal((FEATURES, HIDDEN)).astype(np.float32) * 0.1,
          np.zeros(HIDDEN, np.float32),
          rng.standard_normal((HIDDEN, CLASSES)).astype(np.float32) * 0.1,
          np.zeros(CLASSES, np.float32)]


def _mlp_logits_tf(params, x):
  w1, b1, w2, b2 = params
  return tf.nn.relu(x @ w1 + b1) @ w2 + b2


def _mlp_logits_jax(params, x):
  w1, b1, w2, b2 = params
  return jax.nn.relu(x @ w1 + b1) @ w2 + b2


def _tf_loss(logits_fn, params, x, y):
  return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=y, logits=logits_fn(params, x)))


def _tf_step(logits_fn):
  def step(params, x, y):
    with tf.GradientTape() as tape:
      tape.watch(params)
      loss = _tf_loss(logits_fn, params, x, y)
    grads = lax.pmean(tape.gradient(loss, params), AXIS)
    return [p - 0.1 * g for p, g in zip(params, grads)], lax.pmean(loss, AXIS)
  return step


def _jax_step(logits_fn):
  def loss_fn(params, x, y):
    logits = logits_fn(params, x)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None],
                                         axis=1))

  def step(params, x, y):
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    grads = jax.lax.pmean(grads, AXIS)
    return [p - 0.1 * g for p, g in zip(params, grads)], jax.lax.pmean(loss, AXIS)
  return step


def _jax_steps(step):
  def run(params, xs, ys):
    return jax.lax.scan(lambda p, xy: step(p, *xy), params, (xs, ys))
  return run


def _conv_params(seed=0):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal((3, 3, 1, 8)).astype(np.float32) * 0.3,
          rng.standard_normal((8 * 8 * 8, CLASSES)).astype(np.float32) * 0.05]


def _conv_logits_tf(params, x):
  kernel, dense = params
  h = tf.nn.relu(tf.nn.conv2d(x, kernel, 1, "SAME"))
  return tf.reshape(h, [-1, 8 * 8 * 8]) @ dense


def _conv_logits_jax(params, x):
  kernel, dense = params
  h = jax.nn.relu(jax.lax.conv_general_dilated(
      x, kernel, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))
  return h.reshape(-1, 8 * 8 * 8) @ dense


MODELS = {
    "mlp": (_init_mlp, _mlp_logits_tf, _mlp_logits_jax, (FEATURES,)),
    "conv": (_conv_params, _conv_logits_tf, _conv_logits_jax, (8, 8, 1)),
}


def _batches(count, k, feature_shape, seed=1):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((count, k, PER_DEVICE_BATCH) + feature_shape)
  y = rng.integers(0, CLASSES, (count, k, PER_DEVICE_BATCH))
  return x.astype(np.float32), y.astype(np.int32)


def _carried(step, params, xs, ys):
  """A contender calling `step(params, xs, ys) -> (params, losses)`.

  The parameters it returns feed its next call. Returns the contender and
  the seconds its first two calls took: the first traces and compiles; the
  second gets the parameters from the devices, which may compile again
  (DTensor expands a function again when small inputs that were placed from
  the host arrive as another call's outputs).
  """
  state = {"params": params}

  def call():
    state["params"], losses = step(state["params"], xs, ys)
    return losses

  contender = _blocking(call)
  seconds = []
  for _ in range(2):
    start = time.perf_counter()
    contender()
    seconds.append(time.perf_counter() - start)
  return contender, tuple(seconds)


def _training_contenders(count, model, k, devices=None):
  init, tf_logits, jax_logits, feature_shape = MODELS[model]
  x, y = _batches(count, k, feature_shape)
  contenders, warmup = {}, {}

  ours = tfspmd.pmap(_tf_step(tf_logits), AXIS, in_axes=(None, 0, 0),
                     out_axes=(None, 0), steps=k,
                     devices=None if devices is None else devices[:count])
  place = tfspmd.pmap(lambda v: v, AXIS,
                      devices=None if devices is None else devices[:count])
  contenders[f"tfspmd K={k}"], warmup["tfspmd"] = _carried(
      ours, init(), place(x), place(y))
  if devices is None:
    on_dtensor = functools.partial(timing.on_executor, "dtensor")
    contenders[f"tfspmd DTensor executor K={k}"], warmup["tfspmd dtensor"] = (
        _carried(lambda *a: on_dtensor(lambda: ours(*a))(), init(),
                 on_dtensor(lambda: place(x))(), on_dtensor(lambda: place(y))()))

  jax_devices = jax.local_devices()[:count]
  theirs = jax.pmap(_jax_steps(_jax_step(jax_logits)), AXIS,
                    in_axes=(None, 0, 0), out_axes=(None, 0), devices=jax_devices)
  place_jax = jax.pmap(lambda v: v, AXIS, devices=jax_devices)
  contenders[f"jax.pmap K={k}"], warmup["jax"] = _carried(
      theirs, [jnp.asarray(p) for p in init()], place_jax(x), place_jax(y))
  return contenders, warmup


def _mirrored_contender(count, model, k):
  init, tf_logits, _, feature_shape = MODELS[model]
  x, y = _batches(count, k, feature_shape)
  strategy = _mirrored(count)
  with strategy.scope():
    params = [tf.Variable(p) for p in init()]

  def replica_step(xs, ys, t):
    with tf.GradientTape() as tape:
      loss = _tf_loss(tf_logits, params, xs[t], ys[t])
    grads = tape.gradient(loss, params)
    grads = tf.distribute.get_replica_context().all_reduce("mean", grads)
    for p, g in zip(params, grads):
      p.assign_sub(0.1 * g)

  @tf.function
  def train(xs, ys):
    for t in tf.range(k):
      strategy.run(replica_step, args=(xs, ys, t))

  xs = strategy.experimental_distribute_values_from_function(
      lambda context: tf.constant(x[context.replica_id_in_sync_group]))
  ys = strategy.experimental_distribute_values_from_function(
      lambda context: tf.constant(y[context.replica_id_in_sync_group]))

  def call():
    train(xs, ys)
    return params[0].numpy()

  return _blocking(call)


def _plain_dtensor_contender(count, model, k):
  """The same training written directly in DTensor, without tfspmd.

  The batch is split over a 1-D mesh, the parameters replicated, and the
  K steps a `tf.while_loop` in one jit-compiled function: what DTensor
  itself costs for the program tfspmd makes of the pmapped step.
  """
  init, tf_logits, _, feature_shape = MODELS[model]
  x, y = _batches(count, k, feature_shape)
  mesh = dtensor.create_mesh([(AXIS, count)],
                             devices=[f"CPU:{d}" for d in range(count)])

  def split_rows(per_device):
    # (count, k, batch, ...) -> the global (k, count * batch, ...), split.
    rank = per_device.ndim - 1
    layout = dtensor.Layout(
        [dtensor.UNSHARDED, AXIS] + [dtensor.UNSHARDED] * (rank - 2), mesh)
    return dtensor.pack([tf.constant(block) for block in per_device], layout)

  xs, ys = split_rows(x), split_rows(y)

  @tf.function(jit_compile=True)
  def train(params, xs, ys):
    def step(t, params, _):
      # Pinned: DTensor's layout propagation would split a conv's input
      # spatially, which it supports only on TPU.
      x_t, y_t = (dtensor.relayout(v[t], dtensor.Layout.batch_sharded(
          mesh, AXIS, rank=v.shape.rank - 1)) for v in (xs, ys))
      with tf.GradientTape() as tape:
        tape.watch(params)
        loss = _tf_loss(tf_logits, params, x_t, y_t)
      grads = tape.gradient(loss, params)
      return t + 1, [p - 0.1 * g for p, g in zip(params, grads)], loss
    _, params, loss = tf.while_loop(lambda t, *_: t < k, step,
                                    (0, params, 0.0))
    return params, loss

  state = {"params": [
      dtensor.copy_to_mesh(tf.constant(p), dtensor.Layout.replicated(
          mesh, p.ndim)) for p in init()]}

  def call():
    state["params"], loss = train(state["params"], xs, ys)
    return loss.numpy()

  return _blocking(call)


def training(count, options):
  rows, results = [], {}
  for model in MODELS:
    for k in (1, 10, 100):
      if options.quick and k > 1:
        continue
      contenders, _ = _training_contenders(count, model, k)
      contenders[f"MirroredStrategy K={k}"] = _mirrored_contender(count, model, k)
      contenders[f"plain DTensor K={k}"] = _plain_dtensor_contender(
          count, model, k)
      summary = timing.summarize(timing.interleaved(
          contenders, rounds=options.rounds, calls_per_round=2 if k == 1 else 1,
          warmup=2))
      for name, stats in summary.items():
        per_second = k * count * PER_DEVICE_BATCH / (stats["median_us"] * 1e-6)
        results[f"{model} {name}"] = dict(stats, examples_per_second=per_second)
        rows.append(dict(model=model, contender=name,
                         call_ms=stats["median_us"] / 1e3,
                         examples_per_second=per_second))
  by_name = {f"{r['model']} {r['contender']}": r for r in rows}
  for row in rows:
    k = row["contender"].split("K=")[1]
    ours = by_name[f"{row['model']} tfspmd K={k}"]["examples_per_second"]
    row["tfspmd_over_this"] = ours / row["examples_per_second"]
  timing.print_table(
      f"Data-parallel training, {count} devices, {PER_DEVICE_BATCH} examples "
      f"per device", rows,
      ["model", "contender", "call_ms", "examples_per_second", "tfspmd_over_this"])
  timing.write_results("compare_training", dict(
      machine=timing.machine(), results=results, rows=rows,
      load_average=os.getloadavg()))


_COMPILE_CHILD = r"""
import json, sys
from benchmarks import compare
print(json.dumps(compare.first_two_calls(sys.argv[1], sys.argv[2])))
"""


def first_two_calls(who, model, count=None):
  """Seconds of the first two calls of one contender's training step.

  Run in a fresh process per measurement: a first call is paid once per
  process, and a contender measured after another would find TensorFlow's
  or XLA's lazy set-up already done.
  """
  count = count or tfspmd.device_count()
  init, tf_logits, jax_logits, feature_shape = MODELS[model]
  x, y = _batches(count, 1, feature_shape)
  if who == "tfspmd":
    step = tfspmd.pmap(_tf_step(tf_logits), AXIS, in_axes=(None, 0, 0),
                       out_axes=(None, 0), steps=1)
    place = tfspmd.pmap(lambda v: v, AXIS)
    params = init()
  else:
    step = jax.pmap(_jax_steps(_jax_step(jax_logits)), AXIS,
                    in_axes=(None, 0, 0), out_axes=(None, 0))
    place = jax.pmap(lambda v: v, AXIS)
    params = [jnp.asarray(p) for p in init()]
  _, seconds = _carried(step, params, place(x), place(y))
  return seconds


def compile_time(count, options):
  """First calls, each contender in fresh processes taking turns."""
  del count
  rows, samples = [], {}
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  for model in MODELS:
    for _ in range(options.processes):
      for who in ("tfspmd", "jax"):
        out = subprocess.run(
            [sys.executable, "-c", _COMPILE_CHILD, who, model],
            capture_output=True, text=True, check=True, cwd=root,
            env=dict(os.environ), timeout=600)
        samples.setdefault((model, who), []).append(
            json.loads(out.stdout.strip().splitlines()[-1]))
    medians = {who: np.median(np.array(samples[(model, who)]), axis=0)
               for who in ("tfspmd", "jax")}
    rows.append(dict(model=model, tfspmd_s=medians["tfspmd"][0],
                     jax_s=medians["jax"][0],
                     ratio=medians["tfspmd"][0] / medians["jax"][0],
                     tfspmd_second_s=medians["tfspmd"][1],
                     jax_second_s=medians["jax"][1]))
  timing.print_table(
      f"First call of a training step (trace + compile + run), and the second "
      f"(parameters from the devices): medians of {options.processes} fresh "
      f"processes per contender, taking turns", rows,
      ["model", "tfspmd_s", "jax_s", "ratio", "tfspmd_second_s",
       "jax_second_s"])
  timing.write_results("compare_compile", dict(
      machine=timing.machine(), rows=rows, load_average=os.getloadavg(),
      samples={f"{model} {who}": values
               for (model, who), values in samples.items()}))


def scaling(count, options):
  rows = []
  devices = tfspmd.devices()
  for n in (1, 2, 4, 8):
    if n > count:
      break
    contenders, _ = _training_contenders(n, "mlp", 1, devices=devices)
    summary = timing.summarize(timing.interleaved(
        contenders, rounds=options.rounds, calls_per_round=3, warmup=2))
    for name, stats in summary.items():
      rows.append(dict(devices=n, contender=name.split(" K=")[0],
                       step_ms=stats["median_us"] / 1e3))
  timing.print_table(f"MLP step time, {PER_DEVICE_BATCH} examples per device",
                     rows, ["devices", "contender", "step_ms"])
  timing.write_results("compare_scaling", dict(
      machine=timing.machine(), rows=rows, load_average=os.getloadavg()))


# --- 6. memory ----------------------------------------------------------------

_MEMORY_CHILD = r"""
import os, sys, numpy as np
who, program = sys.argv[1], sys.argv[2]
count = int(os.environ["TFSPMD_NUM_CPU_DEVICES"])
if who == "jax":
    import jax, jax.numpy as jnp
    pmap, total, psum = jax.pmap, jnp.sum, jax.lax.psum
else:
    import tensorflow as tf, tfspmd
    pmap, total, psum = tfspmd.pmap, tf.reduce_sum, tfspmd.lax.psum
programs = {"sum": total, "identity": lambda v: v, "double": lambda v: v * 2}
x = np.ones((count, (1 << 30) // 4 // count), np.float32)
x[:, ::1024] = 2.0
def status_kib(field):
    with open("/proc/self/status") as f:
        return int(next(l for l in f if l.startswith(field)).split()[1])
def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
if program == "psum":
    function = pmap(lambda v: psum(v, "i"), "i", out_axes=None)
else:
    function = pmap(programs[program])
np.asarray(function(np.ones((count, 64), np.float32)))
before = status_kib("VmRSS")
reset_peak()
placed = function(x)
placed.block_until_ready()
call_peak, after_call = status_kib("VmHWM"), status_kib("VmRSS")
reset_peak()
fetched = np.asarray(placed)
first = {"identity": 2.0, "double": 4.0, "psum": 2.0 * count}.get(program)
assert first is None or fetched.ravel()[0] == first, fetched.ravel()[:4]
print(before, call_peak, after_call, status_kib("VmHWM"), status_kib("VmRSS"))
"""


def memory(count, options):
  """Host RSS of a child process placing a 1 GiB mapped input and reading the result.

  Peaks are the child's VmHWM, reset before the call and again before the
  read (getrusage's ru_maxrss would carry over the parent's peak through
  exec). `sum` places the input and returns one number per device (the
  cost of placing); `identity` also returns the placed array, split over
  the devices, and reads it back whole (1 GiB); `double` returns a new
  1 GiB array and reads it back; `psum` returns the sum over the devices
  whole on each (128 MiB), read back once. TensorFlow's oneDNN CPU
  allocator keeps the memory programs free for reuse; the `oneDNN off` rows
  run with `TF_ENABLE_ONEDNN_OPTS=0`, whose allocator gives it back.
  """
  del options
  rows = []
  contenders = (("tfspmd", "tfspmd", {}),
                ("tfspmd, oneDNN off", "tfspmd", {"TF_ENABLE_ONEDNN_OPTS": "0"}),
                ("jax", "jax", {}))
  for program in ("sum", "identity", "double", "psum"):
    for name, who, settings in contenders:
      out = subprocess.run([sys.executable, "-c", _MEMORY_CHILD, who, program],
                           capture_output=True, text=True, check=True,
                           env=dict(os.environ, **settings), timeout=600)
      before, call_peak, after_call, read_peak, after_read = (
          int(v) / 2**20 for v in out.stdout.split()[-5:])
      rows.append(dict(program=program, contender=name,
                       baseline_gib=before,
                       call_peak_gib=call_peak - before,
                       after_call_gib=after_call - before,
                       read_peak_gib=read_peak - before,
                       after_read_gib=after_read - before))
  timing.print_table(
      f"Placing a 1 GiB mapped input on {count} devices and reading the "
      f"result: host RSS over the baseline (which includes the 1 GiB NumPy "
      f"input)", rows,
      ["program", "contender", "baseline_gib", "call_peak_gib",
       "after_call_gib", "read_peak_gib", "after_read_gib"])
  timing.write_results("compare_memory", dict(machine=timing.machine(),
                                              rows=rows))


SECTIONS = {"dispatch": dispatch, "roundtrip": roundtrip,
            "bandwidth": bandwidth, "training": training,
            "compile": compile_time, "memory": memory, "scaling": scaling}


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawTextHelpFormatter)
  parser.add_argument("--only", nargs="*", choices=sorted(SECTIONS))
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--calls", type=int, default=30)
  parser.add_argument("--processes", type=int, default=5,
                      help="fresh processes per contender for `compile`")
  parser.add_argument("--quick", action="store_true",
                      help="small sizes only, K = 1 only (a smoke run)")
  options = parser.parse_args()
  count = tfspmd.device_count()
  started = time.perf_counter()
  for name in options.only or SECTIONS:
    section_start = time.perf_counter()
    SECTIONS[name](count, options)
    print(f"[{name}: {time.perf_counter() - section_start:.0f} s]")
  print(f"\nall sections: {time.perf_counter() - started:.0f} s; results in "
        f"{timing.RESULTS_DIR}")


if __name__ == "__main__":
  main()
