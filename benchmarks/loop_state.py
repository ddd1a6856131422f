"""Steps 1-10 of a training loop whose state goes out and back in, against JAX.

The loop of Flax's examples, on a small conv net with batch statistics: the
state (weights, biases of 16 and 10, a scale, running moments of 16, a step
count, a loss average that starts after 3 warm-up steps) leaves each call
and comes back into the next. Each contender's ten steps run in a fresh
process (a first call is paid once per process), the contenders taking
turns; every step waits for its loss and its whole state. The table gives
the median seconds of each step over the processes, and for tfspmd what
steps 2-10 made: DTensor lowerings and compiled functions (0 and 0: the
loop compiled once).

Contenders:
  tfspmd replicated   state in with in_axes=None, out with out_axes=None,
                      NumPy at the first step (a new user's port)
  tfspmd mapped       state copied to each device (device_put_replicated),
                      in and out mapped (Flax's replicate)
  tfspmd via NumPy    replicated, fetched to NumPy between steps
  tfspmd shard_map    state P(), batch P('i')
  jax replicated      jax.pmap with in_axes=None, out_axes=None
  jax mapped          jax.pmap of state stacked once per device (as
                      flax.jax_utils.replicate gives it)

Run: python -m benchmarks.loop_state [--processes N]
(needs the `benchmarks` extra: jax and jaxlib)
"""

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import timing  # pylint: disable=wrong-import-position

DEVICES, BATCH, SIZE, CHANNELS, CLASSES, STEPS, WARM_UP = 8, 16, 8, 16, 10, 10, 3
CONTENDERS = ("tfspmd replicated", "tfspmd mapped", "tfspmd via NumPy",
              "tfspmd shard_map", "jax replicated", "jax mapped")


def initial_state(seed=0):
  rng = np.random.default_rng(seed)
  f = np.float32
  return {
      "params": {
          "k1": (rng.standard_normal((3, 3, 1, CHANNELS)) * 0.3).astype(f),
          "b1": np.zeros(CHANNELS, f),
          "scale": np.ones(CHANNELS, f),
          "k2": (rng.standard_normal((3, 3, CHANNELS, CHANNELS)) * 0.1
                 ).astype(f),
          "dense": (rng.standard_normal((CHANNELS * SIZE * SIZE, CLASSES))
                    * 0.05).astype(f),
          "bias": np.zeros(CLASSES, f)},
      "moments": {"mean": np.zeros(CHANNELS, f), "var": np.ones(CHANNELS, f)},
      "step": np.int32(0),
      "average": np.float32(0.0)}


def batch(seed=1):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((DEVICES, BATCH, SIZE, SIZE, 1)).astype(np.float32)
  y = rng.integers(0, CLASSES, (DEVICES, BATCH)).astype(np.int32)
  return x, y


def tf_step(state, x, y, axis):
  """One device's step (TensorFlow): batch norm over all devices' rows."""
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  from tfspmd import lax  # pylint: disable=import-outside-toplevel
  p = state["params"]
  with tf.GradientTape() as tape:
    tape.watch(p)
    h = tf.nn.conv2d(x, p["k1"], 1, "SAME") + p["b1"]
    mean, var = lax.pmean(tf.nn.moments(h, [0, 1, 2]), axis)
    h = tf.nn.relu((h - mean) * tf.math.rsqrt(var + 1e-5) * p["scale"])
    h = tf.nn.relu(tf.nn.conv2d(h, p["k2"], 1, "SAME"))
    logits = tf.reshape(h, [-1, CHANNELS * SIZE * SIZE]) @ p["dense"]
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
        y, logits + p["bias"]))
  grads = lax.pmean(tape.gradient(loss, p), axis)
  loss = lax.pmean(loss, axis)
  rate = 0.1 * tf.minimum(1.0, tf.cast(state["step"] + 1, tf.float32) / 3.0)
  moments = state["moments"]
  return {
      "params": {k: p[k] - rate * grads[k] for k in p},
      "moments": {"mean": 0.9 * moments["mean"] + 0.1 * mean,
                  "var": 0.9 * moments["var"] + 0.1 * var},
      "step": state["step"] + 1,
      "average": tf.where(state["step"] >= WARM_UP,
                          0.9 * state["average"] + 0.1 * loss,
                          state["average"])}, loss


def jax_step(state, x, y, axis):
  """The same step in JAX."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel

  def loss_of(p):
    h = jax.lax.conv_general_dilated(
        x, p["k1"], (1, 1), "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC")) + p["b1"]
    mean = jax.lax.pmean(h.mean((0, 1, 2)), axis)
    var = jax.lax.pmean(((h - h.mean((0, 1, 2))) ** 2).mean((0, 1, 2)), axis)
    h = jax.nn.relu((h - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"])
    h = jax.nn.relu(jax.lax.conv_general_dilated(
        h, p["k2"], (1, 1), "SAME",
        dimension_numbers=("NHWC", "HWIO", "NHWC")))
    logits = h.reshape(-1, CHANNELS * SIZE * SIZE) @ p["dense"] + p["bias"]
    log_p = jax.nn.log_softmax(logits)
    loss = -jnp.take_along_axis(log_p, y[:, None], 1).mean()
    return loss, (mean, var)

  p = state["params"]
  (loss, (mean, var)), grads = jax.value_and_grad(loss_of, has_aux=True)(p)
  grads, loss = jax.lax.pmean((grads, loss), axis)
  rate = 0.1 * jnp.minimum(1.0, (state["step"] + 1) / 3.0)
  moments = state["moments"]
  return {
      "params": {k: p[k] - rate * grads[k] for k in p},
      "moments": {"mean": 0.9 * moments["mean"] + 0.1 * mean,
                  "var": 0.9 * moments["var"] + 0.1 * var},
      "step": state["step"] + 1,
      "average": jnp.where(state["step"] >= WARM_UP,
                           0.9 * state["average"] + 0.1 * loss,
                           state["average"])}, loss


def _tfspmd_loop(contender):
  """`(call, state, between)` of a tfspmd contender."""
  import tfspmd  # pylint: disable=import-outside-toplevel
  from tfspmd.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel
  state = initial_state()
  between = lambda s: s  # pylint: disable=unnecessary-lambda-assignment
  if contender == "tfspmd shard_map":
    mesh = tfspmd.make_mesh((DEVICES,), ("i",))
    mapped = tfspmd.shard_map(
        lambda s, x, y: tf_step(s, x, y, "i"), mesh=mesh,
        in_specs=(P(), P("i"), P("i")), out_specs=(P(), P()))
    return mapped, state, between
  if contender == "tfspmd mapped":
    state = tfspmd.device_put_replicated(state, tfspmd.devices())
    return tfspmd.pmap(lambda s, x, y: tf_step(s, x, y, "i"), "i"), state, between
  if contender == "tfspmd via NumPy":
    between = tfspmd.device_get
  call = tfspmd.pmap(lambda s, x, y: tf_step(s, x, y, "i"), "i",
                     in_axes=(None, 0, 0), out_axes=(None, None))
  return call, state, between


def _jax_loop(contender):
  import jax  # pylint: disable=import-outside-toplevel
  state = initial_state()
  if contender == "jax mapped":
    # What flax.jax_utils.replicate gives (JAX 0.10 has no
    # device_put_replicated): a copy per device, stacked.
    state = jax.tree.map(lambda v: np.stack([v] * DEVICES), state)
    return jax.pmap(lambda s, x, y: jax_step(s, x, y, "i"), "i"), state
  return jax.pmap(lambda s, x, y: jax_step(s, x, y, "i"), "i",
                  in_axes=(None, 0, 0), out_axes=(None, None)), state


def ten_steps(contender):
  """Seconds of each of ten steps, and what steps 2-10 lowered and compiled."""
  x, y = batch()
  made = None
  if contender.startswith("jax"):
    import jax  # pylint: disable=import-outside-toplevel
    call, state = _jax_loop(contender)
    between, wait = (lambda s: s), jax.block_until_ready
    counts = lambda: (0, 0)  # pylint: disable=unnecessary-lambda-assignment
  else:
    import tfspmd  # pylint: disable=import-outside-toplevel
    from tfspmd._src.core import tf_internal  # pylint: disable=import-outside-toplevel
    call, state, between = _tfspmd_loop(contender)
    wait, counts = tfspmd.block_until_ready, tf_internal.dtensor_lowerings_and_kernels
  if contender == "tfspmd shard_map":
    x, y = x.reshape((-1,) + x.shape[2:]), y.reshape(-1)
  seconds, losses = [], []
  for number in range(STEPS):
    if number == 1:
      before = counts()
    start = time.perf_counter()
    state, loss = call(between(state) if number else state, x, y)
    wait((state, loss))
    seconds.append(time.perf_counter() - start)
    losses.append(float(np.asarray(loss).reshape(-1)[0]))
  after = counts()
  made = [after[0] - before[0], after[1] - before[1]]
  return {"seconds": seconds, "losses": losses, "made": made}


_CHILD = r"""
import json, sys
from benchmarks import loop_state
print(json.dumps(loop_state.ten_steps(sys.argv[1])))
"""


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--processes", type=int, default=5,
                      help="fresh processes per contender (default 5)")
  options = parser.parse_args()
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, TFSPMD_NUM_CPU_DEVICES=str(DEVICES),
             TF_CPP_MIN_LOG_LEVEL="2",
             XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES}")
  samples = {name: [] for name in CONTENDERS}
  for _ in range(options.processes):
    for name in CONTENDERS:
      out = subprocess.run([sys.executable, "-c", _CHILD, name],
                           capture_output=True, text=True, check=True,
                           cwd=root, env=env, timeout=600)
      samples[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
  rows = []
  for name in CONTENDERS:
    steps = np.median([s["seconds"] for s in samples[name]], axis=0)
    row = {"contender": name}
    row.update({f"step {k + 1}": float(v) for k, v in enumerate(steps)})
    row["steps 2-10 made"] = (
        "-" if name.startswith("jax") else
        " / ".join(str(max(s["made"][i] for s in samples[name]))
                   for i in range(2)))
    rows.append(row)
  losses = {name: samples[name][0]["losses"] for name in CONTENDERS}
  timing.print_table(
      f"Seconds of each step, medians of {options.processes} fresh processes "
      f"per contender ({DEVICES} CPU devices); 'made': the most DTensor "
      f"lowerings / compiled functions of steps 2-10 in any process", rows,
      ["contender"] + [f"step {k + 1}" for k in range(STEPS)] +
      ["steps 2-10 made"])
  spread = max(abs(a - b) for name in CONTENDERS
               for a, b in zip(losses[name], losses["jax replicated"]))
  print(f"\nLargest difference of a step's loss from JAX's: {spread:.2e}")
  path = timing.write_results("loop_state", dict(
      machine=timing.machine(), rows=rows, samples=samples,
      load_average=os.getloadavg()))
  print(f"Results written to {path}")


if __name__ == "__main__":
  main()
