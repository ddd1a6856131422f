"""The trace cache: bounded, least recently used evicted first, thread-safe."""

import gc
import threading
import weakref

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd import P
from tfspmd._src.core import lru


@pytest.fixture
def cache_size_3(monkeypatch):
  monkeypatch.setattr(lru, "TRACE_CACHE_SIZE", 3)


def _counting_pmap():
  traces = []

  def f(x):
    traces.append(tuple(x.shape))
    return x * 2.

  return tfspmd.pmap(f), traces


def test_ever_new_shapes_keep_the_cache_bounded(cache_size_3):
  f, traces = _counting_pmap()
  for width in range(1, 11):
    x = np.arange(8 * width, dtype=np.float32).reshape(8, width)
    np.testing.assert_array_equal(f(x), x * 2.)
    assert len(f._programs) == min(width, 3)  # pylint: disable=protected-access
  assert len(traces) == 10


def test_host_and_device_inputs_of_one_shape_share_a_trace():
  f, traces = _counting_pmap()
  x = np.arange(16, dtype=np.float32).reshape(8, 2)
  on_devices = f(x)  # a ShardedArray: placed where the program wants it
  twice_on_devices = f(on_devices)
  np.testing.assert_array_equal(twice_on_devices, x * 4.)
  np.testing.assert_array_equal(f(x), x * 2.)
  assert traces == [(2,)]


def test_positional_and_keyword_arrays_of_one_signature_share_a_trace():
  f, traces = _counting_pmap()
  x = np.ones((8, 2), np.float32)
  for value in (x, tf.constant(x), f(x), x):
    np.testing.assert_array_equal(f(value), np.asarray(value) * 2.)
  np.testing.assert_array_equal(f(x=x), x * 2.)  # another tree: traced anew
  np.testing.assert_array_equal(f(x.astype(np.float16)), x * 2.)  # a dtype
  np.testing.assert_array_equal(f(np.ones((8, 3), np.float32)), 2.)
  assert traces == [(2,), (2,), (2,), (3,)]


def test_the_least_recently_used_program_is_evicted(cache_size_3):
  f, traces = _counting_pmap()
  shapes = {w: np.ones((8, w), np.float32) for w in (1, 2, 3, 4)}
  for w in (1, 2, 3):
    f(shapes[w])
  f(shapes[1])  # a hit: width 2 is now the least recently used
  assert len(traces) == 3
  f(shapes[4])  # evicts width 2
  f(shapes[1])
  f(shapes[3])
  assert len(traces) == 4
  f(shapes[2])  # traced again
  assert traces == [(1,), (2,), (3,), (4,), (2,)]


def test_vmap_and_leaf_axes_caches_are_bounded(cache_size_3):
  g = tfspmd.vmap(lambda x: x)
  f = tfspmd.pmap(lambda x: x)
  for count in range(1, 8):  # a list of `count` leaves: a new structure
    g([np.zeros(2)] * count)
    f([np.zeros(8, np.float32)] * count)
  assert len(g._functions) == 3  # pylint: disable=protected-access
  assert len(f._options.args._leaf_axes) == 3  # pylint: disable=protected-access


def test_lru_cache_keeps_maxsize_under_concurrent_use():
  cache = lru.LRUCache(16)
  errors = []

  def work(offset):
    try:
      for k in range(2000):
        cache.put((offset, k % 40), k)
        cache.get((offset, (k * 7) % 40))
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert not errors
  assert len(cache) == 16


def test_lru_cache_rejects_a_bad_size():
  with pytest.raises(ValueError, match="`maxsize` must be a positive int"):
    lru.LRUCache(0)


def test_a_shard_map_built_in_each_call_traces_once():
  # A step function that calls shard_map(f, ...)(x) on every call, as JAX
  # code under jax.jit does: the same function, mesh and specs share traces.
  mesh = tfspmd.make_mesh((2, 4), ("a", "b"))
  traces = []

  def f(block):
    traces.append(tuple(block.shape))
    return tfspmd.lax.psum(block, "b")

  def step(value, in_specs=tfspmd.P("a", "b"), out_specs=tfspmd.P("a", None),
           on=mesh):
    return np.asarray(tfspmd.shard_map(f, mesh=on, in_specs=in_specs,
                                       out_specs=out_specs)(value))

  x = np.arange(32, dtype=np.float32).reshape(8, 4)
  row_sums = x.sum(axis=1, keepdims=True)
  for _ in range(3):
    np.testing.assert_array_equal(step(x), row_sums)
  assert len(traces) == 1
  # Spec trees count by their structure: a spec per argument in a tuple
  # is another program than one spec for all, shared in turn.
  for _ in range(2):
    np.testing.assert_array_equal(step(x, in_specs=(tfspmd.P("a", "b"),)),
                                  row_sums)
  assert len(traces) == 2
  # Other specs, or another mesh, are another program.
  np.testing.assert_array_equal(
      step(x, out_specs=tfspmd.P("a", "b")), np.repeat(row_sums, 4, axis=1))
  other = tfspmd.make_mesh((2, 4), ("a", "b"),
                           devices=tfspmd.devices()[::-1])
  np.testing.assert_array_equal(step(x, on=other), row_sums)
  assert len(traces) == 4


def test_a_pmap_built_in_each_call_traces_once():
  # `pmap(f)(x)` written anew each time (in a loop, or in a step function)
  # keeps its traces, as jax.pmap's cache keyed on the function does.
  traces = []

  def f(x, scale):
    traces.append(tuple(x.shape))
    return x * scale

  x = np.arange(16, dtype=np.float32).reshape(8, 2)
  for _ in range(3):
    out = tfspmd.pmap(f, "i", in_axes=(0, None))(x, 2.)
    np.testing.assert_array_equal(np.asarray(out), x * 2)
  assert len(traces) == 1
  assert tfspmd.pmap(f, "i", in_axes=(0, None)) is tfspmd.pmap(
      f, "i", in_axes=(0, None))
  # Other arguments are another pmap; trees of axes count by structure.
  np.testing.assert_array_equal(
      np.asarray(tfspmd.pmap(f, "j", in_axes=(0, None))(x, 2.)), x * 2)
  assert len(traces) == 2
  listed = tfspmd.pmap(f, "i", in_axes=[0, None])
  assert listed is tfspmd.pmap(f, "i", in_axes=[0, None])
  assert listed is not tfspmd.pmap(f, "i", in_axes=(0, None))


def test_a_pmap_of_an_unhashable_callable_is_not_shared():

  class Scale:
    __hash__ = None

    def __call__(self, x):
      return x * 3.

  scale = Scale()
  assert tfspmd.pmap(scale) is not tfspmd.pmap(scale)
  np.testing.assert_array_equal(np.asarray(tfspmd.pmap(scale)(np.ones(8))),
                                np.full(8, 3.))


# A new closure each call: traced once while it reads the same values, anew
# whenever the function would compute something else.

OFFSET = 1.0


def _new_closure(scale):
  def scaled(x):
    return x * scale + OFFSET
  return tfspmd.pmap(scaled)


@pytest.fixture
def traces(caplog):
  """The names of the functions traced from here on (tfspmd_log_compiles)."""
  tfspmd.config.update("tfspmd_log_compiles", True)
  caplog.set_level("WARNING", logger="tfspmd")
  try:
    yield lambda: [r.getMessage().split(" for ")[0] for r in caplog.records
                   if r.getMessage().startswith("tfspmd: traced")]
  finally:
    tfspmd.config.update("tfspmd_log_compiles", False)


def test_a_new_closure_over_the_same_values_reuses_the_trace(traces):
  x = np.arange(8, dtype=np.float32)
  for _ in range(3):
    np.testing.assert_array_equal(_new_closure(2.0)(x), x * 2. + 1.)
  assert len(traces()) == 1
  np.testing.assert_array_equal(_new_closure(3.0)(x), x * 3. + 1.)
  assert len(traces()) == 2
  # An int of the same value is another value (its own dtype in a tensor).
  np.testing.assert_array_equal(_new_closure(2)(x), x * 2. + 1.)
  assert len(traces()) == 3


def test_a_changed_global_traces_anew(monkeypatch):
  x = np.arange(8, dtype=np.float32)
  np.testing.assert_array_equal(_new_closure(5.0)(x), x * 5. + 1.)
  monkeypatch.setattr(__import__(__name__), "OFFSET", 10.0)
  np.testing.assert_array_equal(_new_closure(5.0)(x), x * 5. + 10.)


def test_a_closure_over_a_mutable_value_traces_anew(traces):
  x = np.arange(8, dtype=np.float32)

  def over(weights):
    return tfspmd.pmap(lambda v: v * weights[0])

  weights = [2.0]
  np.testing.assert_array_equal(over(weights)(x), x * 2.)
  weights[0] = 7.0  # the same list, changed in place
  np.testing.assert_array_equal(over(weights)(x), x * 7.)
  assert len(traces()) == 2


def test_a_changed_default_argument_traces_anew():
  x = np.arange(8, dtype=np.float32)
  outs = [tfspmd.pmap(lambda v, k=k: v * k)(x) for k in (2.0, 4.0, 2.0)]
  for out, k in zip(outs, (2.0, 4.0, 2.0)):
    np.testing.assert_array_equal(out, x * k)


def test_a_rebound_cell_traces_anew():
  x = np.arange(8, dtype=np.float32)
  scale = 2.0

  def f(v):
    return v * scale

  first = tfspmd.pmap(f)(x)
  scale = 3.0  # the same function object, its cell rebound
  second = tfspmd.pmap(f)(x)
  np.testing.assert_array_equal(first, x * 2.)
  np.testing.assert_array_equal(second, x * 3.)


@tf.function
def _halved(v):
  return v / 2.


def test_a_closure_calling_a_tf_function_reuses_the_trace(traces):
  x = np.arange(8, dtype=np.float32)

  def new_closure(shift):
    return tfspmd.pmap(lambda v: _halved(v) + shift)

  for _ in range(3):
    np.testing.assert_array_equal(new_closure(1.0)(x), x / 2. + 1.)
  assert len(traces()) == 1


# Dropped functions: the caches shared by function hold them weakly.


def _alive_after_capturing(make, count=80):
  """Calls `make(big)(x)` for `count` new 1 MiB arrays `big`, then drops them.

  Returns:
    How many of the arrays, and of the mapped functions `make` gave, are
    alive once they are dropped.
  """
  x = np.ones((8, 4), np.float32)
  arrays, mapped = [], []
  for k in range(count):
    big = np.full(1 << 18, k, np.float32)  # 1 MiB
    f = make(big)
    arrays.append(weakref.ref(big))
    mapped.append(weakref.ref(f))
    np.testing.assert_array_equal(np.asarray(f(x)), x + k * (1 << 18))
    del big, f
  gc.collect()
  return (sum(ref() is not None for ref in arrays),
          sum(ref() is not None for ref in mapped))


def test_dropped_closures_free_the_arrays_they_capture():
  # A closure over an array has no key by value: its pmap or shard_map is
  # shared by the function object, which the cache must not keep alive
  # (it kept the last 64: 487 MiB more for these 80 MiB).
  def pmapped(big):
    return tfspmd.pmap(lambda v: v + tf.reduce_sum(big))

  mesh = tfspmd.make_mesh((8,), ("i",))

  def shard_mapped(big):
    return tfspmd.shard_map(lambda v: v + tf.reduce_sum(big), mesh=mesh,
                            in_specs=P("i"), out_specs=P("i"))

  for make in (pmapped, shard_mapped):
    assert _alive_after_capturing(make) == (0, 0), make.__name__


def test_one_function_object_still_shares_its_pmap(traces):
  big = np.full(1 << 10, 1, np.float32)

  def f(v):
    return v + tf.reduce_sum(big)

  x = np.ones((8, 2), np.float32)
  for _ in range(3):
    np.testing.assert_array_equal(tfspmd.pmap(f)(x), x + 1024)
  assert tfspmd.pmap(f) is tfspmd.pmap(f)
  assert len(traces()) == 1


def test_clear_caches_drops_every_trace():
  traced = []

  def doubled(v):
    traced.append(v.shape)
    return v * 2.

  x = np.ones((8, 2), np.float32)
  double = tfspmd.pmap(doubled)
  jitted = tfspmd.jit(doubled)
  for _ in range(2):
    np.testing.assert_array_equal(double(x), x * 2)
    np.testing.assert_array_equal(jitted(x), x * 2)
  assert len(traced) == 2
  tfspmd.clear_caches()
  # The shared pmap is made anew; every function traces again.
  assert tfspmd.pmap(doubled) is not double
  np.testing.assert_array_equal(tfspmd.pmap(doubled)(x), x * 2)
  np.testing.assert_array_equal(jitted(x), x * 2)
  np.testing.assert_array_equal(double(x), x * 2)
  assert len(traced) == 5
