"""The legacy queue-runner input pipeline on small CIFAR-format files."""

import os

import numpy as np
import pytest
import tensorflow.compat.v1 as tf

from cifar10_towers.common import cifar10_format
from cifar10_towers.common import hparams
from cifar10_towers.common import preprocess
from cifar10_towers.legacy import inputs


def _write_test_file(data_dir, n, seed=0):
  """Writes n random records as the test file; returns (images, labels)."""
  rng = np.random.default_rng(seed)
  images = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
  labels = rng.integers(0, 10, n).astype(np.int32)
  batches_dir = cifar10_format.batches_dir(data_dir)
  os.makedirs(batches_dir, exist_ok=True)
  cifar10_format.write_records(
      os.path.join(batches_dir, cifar10_format.EVAL_FILES[0]), images, labels)
  return images, labels


def _run_queues(fetch, num_runs=None):
  """Runs `fetch` with queue runners until OutOfRange (or num_runs times)."""
  results = []
  with tf.Session() as sess:
    sess.run([tf.global_variables_initializer(),
              tf.local_variables_initializer()])
    coord = tf.train.Coordinator()
    threads = tf.train.start_queue_runners(sess=sess, coord=coord)
    try:
      while num_runs is None or len(results) < num_runs:
        results.append(sess.run(fetch))
    except tf.errors.OutOfRangeError:
      pass
    finally:
      coord.request_stop()
      coord.join(threads)
  return results


def test_read_cifar10_decodes_pixels_and_labels(tmp_path):
  images, labels = _write_test_file(str(tmp_path), 3)
  path = cifar10_format.eval_files(str(tmp_path))[0]
  with tf.Graph().as_default():
    queue = tf.train.string_input_producer([path], num_epochs=1, shuffle=False)
    record = inputs.read_cifar10(queue)
    assert record.uint8image.shape.as_list() == [32, 32, 3]
    assert (record.height, record.width, record.depth) == (32, 32, 3)
    got = _run_queues([record.uint8image, record.label])
  assert len(got) == 3
  for k, (image, label) in enumerate(got):
    np.testing.assert_array_equal(image, images[k])
    assert label == labels[k]


def test_inputs_one_epoch_sees_every_record_once_in_order(tmp_path):
  images, labels = _write_test_file(str(tmp_path), 10, seed=1)
  with tf.Graph().as_default():
    batch = inputs.inputs(eval_data=True, data_dir=str(tmp_path), batch_size=4)
    got = _run_queues(batch)
  assert [len(b[1]) for b in got] == [4, 4, 2]
  np.testing.assert_array_equal(np.concatenate([b[1] for b in got]), labels)
  got_images = np.concatenate([b[0] for b in got])
  assert got_images.shape == (10, 24, 24, 3)
  expected = np.stack([preprocess.eval_image(image).numpy() for image in images])
  # Same ops in eager and graph mode: 1e-5 absolute on standardized pixels.
  np.testing.assert_allclose(got_images, expected, atol=1e-5)


def test_distorted_inputs_batches(synth_data_dir):
  with tf.Graph().as_default() as graph:
    images, labels = inputs.distorted_inputs(synth_data_dir, batch_size=8,
                                             num_threads=2, seed=1)
    assert images.shape.as_list() == [8, 24, 24, 3]
    assert labels.shape.as_list() == [8]
    assert labels.dtype == tf.int32
    # One reader, one shuffling queue; min_after_dequeue from the 1000 records.
    types = [op.type for op in graph.get_operations()]
    assert types.count('FixedLengthRecordReaderV2') == 1
    assert types.count('RandomShuffleQueueV2') == 1
    queue = [op for op in graph.get_operations()
             if op.type == 'RandomShuffleQueueV2'][0]
    assert queue.get_attr('min_after_dequeue') == hparams.min_queue_examples(1000)
    assert queue.get_attr('capacity') == hparams.min_queue_examples(1000) + 3 * 8
    got = _run_queues([images, labels], num_runs=2)
  for image_batch, label_batch in got:
    assert image_batch.dtype == np.float32
    assert set(label_batch) <= set(range(10))
    # per_image_standardization: each image has mean 0 and stddev 1.
    np.testing.assert_allclose(image_batch.mean(axis=(1, 2, 3)), 0, atol=1e-4)
    np.testing.assert_allclose(image_batch.std(axis=(1, 2, 3)), 1, atol=1e-3)


def test_missing_data_is_a_data_error(tmp_path):
  with tf.Graph().as_default():
    with pytest.raises(cifar10_format.DataError, match='data_batch_1.bin'):
      inputs.distorted_inputs(str(tmp_path), batch_size=8)
    with pytest.raises(cifar10_format.DataError, match='test_batch.bin'):
      inputs.inputs(eval_data=True, data_dir=str(tmp_path), batch_size=8)
