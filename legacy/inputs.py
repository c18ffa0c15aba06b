"""Reads the CIFAR-10 binary files with TF1 queue runners (upstream cifar10_input.py).

The record format and the per-image preprocessing live in `common/`, shared
with the modern tf.data pipeline; only the readers, queues and batching are
genuinely TF1 and stay here.
"""

import collections

import tensorflow.compat.v1 as tf

from cifar10_towers.common import cifar10_format
from cifar10_towers.common import hparams
from cifar10_towers.common import preprocess

CIFAR10Record = collections.namedtuple('CIFAR10Record',
                                       'key label uint8image height width depth')

# Training records one preprocessing thread reads and distorts per Session run.
RECORDS_PER_READ = 128
STOP_GRACE_PERIOD_SECS = 10  # how long queue threads get to finish at exit


def read_cifar10(filename_queue):
  """Reads and parses one example from the CIFAR-10 data files.

  Call it N times (from N threads) to read N examples in parallel.

  Args:
    filename_queue: a queue of strings with the file names to read from.

  Returns:
    CIFAR10Record with fields
      key: scalar string tensor, the file name and record number.
      label: int32 scalar, 0..9.
      uint8image: uint8 [32, 32, 3] (height, width, depth).
      height, width, depth: 32, 32, 3.
  """
  key, value = tf.FixedLengthRecordReader(cifar10_format.RECORD_BYTES).read(filename_queue)
  uint8image, label = preprocess.decode_record(value)
  return CIFAR10Record(key, label, uint8image, cifar10_format.HEIGHT,
                       cifar10_format.WIDTH, cifar10_format.DEPTH)


def distorted_inputs(data_dir, batch_size,
                     num_threads=hparams.NUM_PREPROCESS_THREADS, seed=None):
  """Distorted, shuffled training batches read with queue runners.

  Args:
    data_dir: str, directory holding `cifar-10-batches-bin/`.
    batch_size: int, images per batch.
    num_threads: int, threads reading and distorting images.
    seed: optional int, seed of the file-name and example shuffling.

  Returns:
    images: float32 [batch_size, 24, 24, 3].
    labels: int32 [batch_size].

  Raises:
    common.cifar10_format.DataError: a training file is missing or malformed.
  """
  filenames = cifar10_format.train_files(data_dir)
  # Deviation from upstream: the epoch size is what is on disk, not 50000.
  # The shuffle queue keeps 40% of it, so that the shuffling mixes well.
  min_queue_examples = hparams.min_queue_examples(cifar10_format.num_examples(filenames))

  with tf.name_scope('data_augmentation'):
    filename_queue = tf.train.string_input_producer(filenames, seed=seed)
    # Deviation from upstream: a thread reads up to RECORDS_PER_READ records
    # per Session run, decodes and distorts them as one batch (each image
    # with its own random values, bit for bit what distort_image computes
    # with them) and enqueues them together; upstream ran the Session once
    # per image, and that per-run overhead was most of the input's CPU time
    # (docs/performance.md).
    _, records = tf.FixedLengthRecordReader(cifar10_format.RECORD_BYTES).read_up_to(
        filename_queue, RECORDS_PER_READ)
    uint8images, labels = preprocess.decode_records(records)
    float_images = preprocess.distort_images(uint8images)

  images, labels = tf.train.shuffle_batch(
      [float_images, labels], batch_size, num_threads=num_threads,
      capacity=min_queue_examples + 3 * batch_size, enqueue_many=True,
      min_after_dequeue=min_queue_examples, seed=seed)
  # Display the training images in the visualizer.
  tf.summary.image('images', images)
  return images, labels


def inputs(eval_data, data_dir, batch_size):
  """Evaluation batches: central crop, standardized, every record once in file order.

  Deviation from upstream: evaluation counts every test record exactly once.
  Upstream cycled through the files forever, with 16 threads; here one
  thread reads one epoch, which then raises OutOfRangeError, and the last
  batch is smaller instead of wrapping around (the epoch counter needs
  `tf.local_variables_initializer()`).

  Args:
    eval_data: bool, read the test file (True) or the training files (False).
    data_dir: str, directory holding `cifar-10-batches-bin/`.
    batch_size: int, images per batch.

  Returns:
    images: float32 [None, 24, 24, 3], batches of batch_size, the last smaller.
    labels: int32 [None].

  Raises:
    common.cifar10_format.DataError: a data file is missing or malformed.
  """
  filenames = (cifar10_format.eval_files if eval_data else cifar10_format.train_files)(data_dir)
  min_queue_examples = hparams.min_queue_examples(cifar10_format.num_examples(filenames))

  with tf.name_scope('input'):
    filename_queue = tf.train.string_input_producer(filenames, num_epochs=1, shuffle=False)
    read_input = read_cifar10(filename_queue)
    float_image = preprocess.eval_image(read_input.uint8image)

  images, labels = tf.train.batch(
      [float_image, read_input.label], batch_size, num_threads=1,
      capacity=min_queue_examples + 3 * batch_size, allow_smaller_final_batch=True)
  tf.summary.image('images', images)
  return images, labels


def close_queue_ops():
  """Ops closing each queue of the default graph's queue runners.

  With cancel_pending_enqueues, so that running them wakes every enqueue
  thread blocked on a full queue.

  Returns:
    list of ops, in the order the queue runners were added.
  """
  return [qr.queue.close(cancel_pending_enqueues=True)
          for qr in tf.get_collection(tf.GraphKeys.QUEUE_RUNNERS)]


def close_queues(sess, close_ops):
  """Runs each op of `close_queue_ops`, in the order given; a queue closed already is no error.

  Closing with cancel_pending_enqueues wakes enqueue threads blocked on a
  full queue, so none of them outlives the session.
  """
  for close in close_ops:
    try:
      sess.run(close)
    except (tf.errors.OpError, RuntimeError):  # RuntimeError: the session is closed
      pass


def stop_queue_threads(sess, coord, threads, close_ops):
  """Stops and joins every queue-runner thread; re-raises what they raised."""
  coord.request_stop()
  close_queues(sess, close_ops)
  coord.join(threads, stop_grace_period_secs=STOP_GRACE_PERIOD_SECS)
