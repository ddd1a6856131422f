"""tfspmd.adapters.tf_data: global batches become per-device batches on the devices."""

import threading

import numpy as np
import pytest
import tensorflow as tf

import tfspmd
from tfspmd.adapters import tf_data

from child_process import run_python


def global_batches(size, batch, features=3):
  x = np.arange(size * features, dtype=np.float32).reshape(size, features)
  y = np.arange(size, dtype=np.int32)
  return x, y, tf.data.Dataset.from_tensor_slices((x, y)).batch(batch)


def test_shapes_and_each_device_holds_its_rows():
  x, y, dataset = global_batches(64, 32)
  batches = list(tf_data.device_batches(dataset))
  assert len(batches) == 2
  for k, (bx, by) in enumerate(batches):
    assert bx.shape == (8, 4, 3) and by.shape == (8, 4)
    assert bx.dtype == tf.float32 and by.dtype == tf.int32
    rows = x[32 * k:32 * (k + 1)].reshape(8, 4, 3)
    for device, shard in enumerate(bx.addressable_shards):
      assert shard.device == tfspmd.local_devices()[device]
      assert shard.data.device.endswith(f"CPU:{device}")
      np.testing.assert_array_equal(shard.data.numpy(), rows[device:device + 1])
    np.testing.assert_array_equal(by, y[32 * k:32 * (k + 1)].reshape(8, 4))


def test_batches_go_into_pmap_as_placed():
  _, _, dataset = global_batches(32, 32)
  bx, by = next(iter(tf_data.device_batches(dataset)))
  f = tfspmd.pmap(lambda x, y: (x * 2, y))
  out, _ = f(bx, by)
  assert out.placement is bx.placement
  np.testing.assert_array_equal(out, np.asarray(bx) * 2)


def test_fewer_devices_and_dict_elements():
  x = np.arange(24, dtype=np.float32).reshape(12, 2)
  dataset = tf.data.Dataset.from_tensor_slices({"a": x, "b": x[:, 0]}).batch(6)
  batches = list(tf_data.device_batches(dataset, num_devices=3))
  assert sorted(batches[0]) == ["a", "b"]
  assert batches[1]["a"].shape == (3, 2, 2)
  assert len(batches[1]["a"].addressable_shards) == 3
  np.testing.assert_array_equal(batches[1]["b"], x[6:, 0].reshape(3, 2))


def test_steps_per_call_stacks_consecutive_batches_per_device():
  x, _, dataset = global_batches(80, 16)  # 5 batches -> chunks of 2, 2, 1
  chunks = list(tf_data.device_batches(dataset, steps_per_call=2))
  assert [c[0].shape for c in chunks] == [(8, 2, 2, 3), (8, 2, 2, 3),
                                          (8, 1, 2, 3)]
  # [step, global batch, ...] -> [device, step, per-device batch, ...]
  expected = x[:64].reshape(2, 2, 8, 2, 3).transpose(0, 2, 1, 3, 4)
  np.testing.assert_array_equal(chunks[0][0], expected[0])
  np.testing.assert_array_equal(chunks[1][0], expected[1])
  np.testing.assert_array_equal(chunks[2][0], x[64:].reshape(8, 1, 2, 3))


def test_steps_per_call_cuts_a_chunk_where_the_batch_size_changes():
  x, _, dataset = global_batches(40, 16)  # batches of 16, 16, 8
  chunks = list(tf_data.device_batches(dataset, steps_per_call=3))
  assert [c[0].shape for c in chunks] == [(8, 2, 2, 3), (8, 1, 1, 3)]
  np.testing.assert_array_equal(chunks[1][0], x[32:].reshape(8, 1, 1, 3))


def test_batch_not_divisible_by_devices_is_an_error():
  _, _, dataset = global_batches(36, 16)  # the last batch has 4 rows
  batches = iter(tf_data.device_batches(dataset))
  next(batches)
  next(batches)
  with pytest.raises(ValueError, match=r"batch 2 has 4 examples, which does "
                     r"not divide by the 8 devices"):
    next(batches)


def test_leaves_with_different_batch_sizes_are_an_error():
  dataset = tf.data.Dataset.from_tensors((tf.zeros([8, 2]), tf.zeros([16])))
  with pytest.raises(ValueError, match="different batch sizes"):
    list(tf_data.device_batches(dataset))


def test_pad_policy_pads_with_zero_weight_rows():
  x, y, dataset = global_batches(20, 16)  # batches of 16 and 4
  batches = list(tf_data.device_batches(dataset, remainder="pad"))
  bx, by, weights = batches[1]
  assert bx.shape == (8, 1, 3)
  np.testing.assert_array_equal(np.asarray(bx)[:4, 0], x[16:])
  np.testing.assert_array_equal(np.asarray(bx)[4:], 0)
  np.testing.assert_array_equal(np.asarray(weights).ravel(), [1] * 4 + [0] * 4)
  np.testing.assert_array_equal(np.asarray(batches[0][2]), np.ones((8, 2)))


def test_pad_policy_pads_given_sample_weights_with_zeros():
  dataset = tf.data.Dataset.from_tensors(
      (tf.ones([6, 2]), tf.ones([6]), tf.fill([6], 0.5)))
  _, _, weights = next(iter(tf_data.device_batches(dataset, remainder="pad")))
  np.testing.assert_array_equal(np.asarray(weights).ravel(),
                                [0.5] * 6 + [0] * 2)


def test_pad_policy_needs_x_y_elements():
  dataset = tf.data.Dataset.from_tensors(tf.ones([6, 2]))
  with pytest.raises(ValueError, match=r"remainder='pad'\) needs elements"):
    tf_data.device_batches(dataset, remainder="pad")


@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_each_process_places_only_its_share(index):
  # 4 processes x 8 local devices: process p gets rows [16p, 16p + 16) of
  # every global batch of 64, two rows per local device.
  x, _, dataset = global_batches(128, 64)
  batches = list(tf_data.device_batches(dataset, process_index=index,
                                        process_count=4))
  for k, (bx, _) in enumerate(batches):
    share = x[64 * k + 16 * index:64 * k + 16 * (index + 1)]
    np.testing.assert_array_equal(bx, share.reshape(8, 2, 3))


def test_processes_share_every_row_exactly_once():
  x, _, dataset = global_batches(96, 48)
  seen = []
  for index in range(3):
    for bx, _ in tf_data.device_batches(dataset, num_devices=2,
                                        process_index=index, process_count=3):
      seen.append(np.asarray(bx).reshape(-1, 3))
  np.testing.assert_array_equal(np.sort(np.concatenate(seen), axis=0), x)


def test_divisibility_counts_the_devices_of_every_process():
  _, _, dataset = global_batches(24, 24)
  with pytest.raises(ValueError, match=r"the 16 devices \(2 process\(es\) x "
                     r"8 local devices\)"):
    list(tf_data.device_batches(dataset, process_index=0, process_count=2))


def test_iterating_again_starts_a_new_epoch():
  x, _, dataset = global_batches(32, 16)
  batches = tf_data.device_batches(dataset)
  first = [np.asarray(b[0]) for b in batches]
  second = [np.asarray(b[0]) for b in batches]
  np.testing.assert_array_equal(np.concatenate(first).reshape(-1, 3)[:16],
                                x[:16])
  np.testing.assert_array_equal(first, second)


def test_next_batches_are_placed_ahead_in_a_thread():
  _, _, dataset = global_batches(64, 8)
  items = iter(tf_data.device_batches(dataset, buffer_size=3))
  next(items)
  threads = [t.name for t in threading.enumerate()]
  assert "tfspmd.adapters.tf_data placement" in threads
  assert len(list(items)) == 7


def test_abandoning_the_iteration_stops_its_thread():
  _, _, dataset = global_batches(64, 8)
  items = iter(tf_data.device_batches(dataset, buffer_size=1))
  next(items)
  items.close()
  assert "tfspmd.adapters.tf_data placement" not in [
      t.name for t in threading.enumerate()]


def test_unbuffered_iteration_gives_the_same_batches():
  _, _, dataset = global_batches(32, 16)
  buffered = [np.asarray(b[0]) for b in tf_data.device_batches(dataset)]
  direct = [np.asarray(b[0]) for b in tf_data.device_batches(
      dataset, buffer_size=0)]
  np.testing.assert_array_equal(buffered, direct)


@pytest.mark.parametrize("kwargs, message", [
    (dict(steps_per_call=0), "`steps_per_call` must be a positive int"),
    (dict(remainder="drop"), "`remainder` must be one of"),
    (dict(buffer_size=-1), "`buffer_size` must be an int >= 0"),
    (dict(num_devices=9), "`num_devices` must be between 1 and the 8"),
    (dict(process_index=2, process_count=2), "`process_index` must be in"),
])
def test_bad_arguments(kwargs, message):
  _, _, dataset = global_batches(16, 8)
  with pytest.raises(ValueError, match=message):
    tf_data.device_batches(dataset, **kwargs)


def test_not_a_dataset():
  with pytest.raises(TypeError, match="must be a tf.data.Dataset"):
    tf_data.device_batches(np.zeros((8, 2)))


@pytest.mark.parametrize("dataset, match", [
    (tf.data.Dataset.from_tensor_slices((np.zeros((16, 3)), np.zeros(16))),
     r"element\[1\] of `dataset` is a scalar .* `dataset.batch\(n\)`"),
    (tf.data.Dataset.from_tensor_slices(
        (tf.sparse.from_dense(np.eye(16)), np.zeros(16))).batch(8),
     r"element\[0\] of `dataset` is a sparse tensor .*tf.sparse.to_dense"),
    (tf.data.Dataset.from_tensors(
        {"x": tf.ragged.constant([[1.0], [2.0, 3.0]] * 4)}),
     r"element\['x'\] of `dataset` is a ragged tensor .*to_tensor\(\)"),
])
def test_unbatched_sparse_and_ragged_elements_are_errors_naming_dataset(
    dataset, match):
  with pytest.raises(ValueError, match=match):
    tf_data.device_batches(dataset)


def test_pad_rows_pads_every_leaf_and_marks_the_real_rows():
  element = {"x": tf.ones([5, 2]), "y": tf.range(5)}
  padded, rows = tf_data.pad_rows(element, 4)
  np.testing.assert_array_equal(padded["x"], np.r_[np.ones((5, 2)),
                                                   np.zeros((3, 2))])
  np.testing.assert_array_equal(padded["y"], [0, 1, 2, 3, 4, 0, 0, 0])
  np.testing.assert_array_equal(rows, [1] * 5 + [0] * 3)


_PLACING_WHILE_COMPILING = """
import threading
import numpy as np
import tensorflow as tf
import tfspmd
from tfspmd import lax
from tfspmd.adapters import tf_data

rows = np.arange(4096 * 4, dtype=np.float32).reshape(4096, 4)
dataset = tf.data.Dataset.from_tensor_slices((rows, rows[:, 0])).batch(16)
stop = threading.Event()
placed = []

def place_batches():
  while not stop.is_set():
    for batch in tf_data.device_batches(dataset.repeat(), steps_per_call=3):
      placed.append(batch)
      del placed[:-2]
      if stop.is_set():
        break

thread = threading.Thread(target=place_batches)
thread.start()
for k in range(12):
  def loop(x, k=k):
    body = lambda i, v: (i + 1, v * (k + 1.0) + lax.psum(v, "i"))
    return tf.while_loop(lambda i, v: i < 2, body, (0, x))[1]
  out = np.asarray(tfspmd.pmap(loop, "i")(np.ones((8, 2), np.float32)))
  print(out[0, 0])
stop.set()
thread.join()
"""


def test_placing_batches_in_a_thread_while_programs_compile():
  # DTensor's device corrupted a mutex and aborted the process when a
  # program's first call and a placement ran in two threads at once: this
  # runs a dozen first calls while batches are placed in a thread.
  run = run_python(_PLACING_WHILE_COMPILING, timeout=300)
  # v <- v * (k + 1) + 8 v twice, from 1.
  expected = [(k + 9.0) ** 2 for k in range(12)]
  np.testing.assert_allclose([float(v) for v in run.stdout.split()], expected)


def test_reading_batches_makes_no_eager_executor(monkeypatch):
  # TensorFlow's `for element in dataset` makes and frees an eager executor
  # per element; a read of a result in another thread waits on every
  # executor and crashed the process when it met a freed one. The placement
  # thread must read its dataset without making any.
  from tensorflow.python.eager import executor  # pylint: disable=g-direct-tensorflow-import
  made = []
  new_executor = executor.new_executor

  def counted(*args, **kwargs):
    made.append(threading.current_thread().name)
    return new_executor(*args, **kwargs)

  monkeypatch.setattr(executor, "new_executor", counted)
  _, y, dataset = global_batches(64, 16)
  batches = list(tf_data.device_batches(dataset, steps_per_call=2))
  assert made == []
  np.testing.assert_array_equal(
      np.concatenate([np.asarray(by).transpose(1, 0, 2).reshape(-1)
                      for _, by in batches]), y)
  assert [int(e) for e in tf_data.dataset_elements(
      tf.data.Dataset.range(3))] == [0, 1, 2]
  assert made == []


_READING_BESIDE_A_DATASET_LOOP = """
import threading
import numpy as np
import tensorflow as tf
import tfspmd

def add_twice(v):
  return tf.while_loop(lambda t, w: t < 2, lambda t, w: (t + 1, w + 1.0),
                       (0, v))[1]

f = tfspmd.pmap(add_twice)
x = np.arange(8, dtype=np.float32)
stop = threading.Event()
walked = [0]

def walk_datasets():
  while not stop.is_set():
    for _ in tf.data.Dataset.range(200):
      walked[0] += 1

thread = threading.Thread(target=walk_datasets)
thread.start()
try:
  sums = [float(np.asarray(f(x)).sum()) for _ in range(4000)]
finally:
  stop.set()
  thread.join()
print(min(sums), max(sums), walked[0] > 0)
"""


def test_reading_results_beside_a_users_dataset_loop():
  # A user's own thread walks datasets with `for`, which makes and frees an
  # eager executor per element, while the main thread reads results: the
  # eager executor's wait, which meets every thread's executors, aborted
  # the process ("Mutex corrupt") or hung within 2,000 reads in half the
  # runs. A read of a value split over the devices waits for that value
  # alone.
  run = run_python(_READING_BESIDE_A_DATASET_LOOP, timeout=180)
  # Each of 8 devices adds 1 twice to its element of 0..7: 28 + 16.
  assert run.stdout.split() == ["44.0", "44.0", "True"]
