"""Input pipelines over the CIFAR-10 binary files, with tf.data.

Mirrors legacy's queue-runner `distorted_inputs` / `inputs`: the record
decoding and the per-image preprocessing are the shared functions of
`common.preprocess`; only the plumbing (tf.data instead of queues) is modern.
"""

import tensorflow as tf

from cifar10_towers.common import cifar10_format as fmt
from cifar10_towers.common import hparams
from cifar10_towers.common import preprocess


# The map functions without autograph: Python that builds ops, with no if/for
# over a tensor (converting them cost a process 0.6 s at its first batch).
@tf.autograph.experimental.do_not_convert
def _distorted_batch(records):
  images, labels = preprocess.decode_records(records)
  return preprocess.distort_images(images), labels


@tf.autograph.experimental.do_not_convert
def _eval_example(record):
  image, label = preprocess.decode_record(record)
  return preprocess.eval_image(image), label


def distorted_inputs(data_dir, batch_size, num_towers, seed=None, num_shards=1,
                     shard_index=0):
  """Distorted training batches for all towers of one step.

  One pipeline feeds every tower (like legacy's one shuffle_batch queue behind
  a shared prefetch queue): each dataset element holds `num_towers` distinct
  batches, tower i takes `images[i]`, `labels[i]`.

  Args:
    data_dir: str, holds cifar-10-batches-bin/data_batch_{1..5}.bin.
    batch_size: int, images per tower.
    num_towers: int, batches per element.
    seed: optional int, seed of the shuffle; with a seed the map also keeps
      element order. The distortions use stateful random ops, so they are
      reproducible only together with `tf.random.set_seed` (and even then
      parallel map calls may draw in a different order).
    num_shards: int, workers that split the records (multi-worker training).
    shard_index: int in [0, num_shards), this worker: it reads records
      shard_index, shard_index + num_shards, ... of the files, so no two
      workers ever train on the same record.

  Returns:
    tf.data.Dataset, repeating forever, of (images, labels):
      images: float32 [num_towers, batch_size, 24, 24, 3]
      labels: int32 [num_towers, batch_size]
    with static shapes.

  Raises:
    common.cifar10_format.DataError: a training file is missing or malformed.
  """
  if not 0 <= shard_index < num_shards:
    raise ValueError(f'shard_index must be in [0, {num_shards}), got {shard_index}')
  filenames = fmt.train_files(data_dir)
  # Per record, before shuffling: the shards are disjoint and cover every record.
  dataset = tf.data.FixedLengthRecordDataset(filenames, fmt.RECORD_BYTES).shard(
      num_shards, shard_index)
  num_examples = len(range(shard_index, fmt.num_examples(filenames), num_shards))
  # Upstream's shuffle_batch keeps min_after_dequeue = 40% of an epoch in its
  # queue; a shuffle buffer of that size mixes as well.
  buffer_size = max(1, hparams.min_queue_examples(num_examples))
  # Deviation from upstream: repeat before shuffle over raw records (3 KB each)
  # instead of shuffling file names and then preprocessed images; the buffer
  # spans epoch boundaries like the queue did, and distortions are per image
  # and independent, so the batches have the same distribution.
  dataset = dataset.repeat().shuffle(buffer_size, seed=seed)
  # Deviation from upstream: records are decoded and distorted a batch at a
  # time (each image with its own random values, bit for bit what
  # distort_image computes with them): a third of the CPU time of one map
  # call per image (docs/performance.md).
  dataset = dataset.batch(batch_size, drop_remainder=True).map(
      _distorted_batch, num_parallel_calls=tf.data.AUTOTUNE, deterministic=seed is not None)
  return _without_autotuning(dataset.batch(num_towers, drop_remainder=True))


def _without_autotuning(dataset):
  """`dataset`, prefetched, without tf.data's autotuning thread: AUTOTUNE then means one
  parallel call per core, and the prefetch buffer grows as the consumer waits.

  That thread waits out its current period (seconds, doubling as the run goes on)
  before the iterator can be deleted (TF 2.21): a run stopped by a signal,
  and every run and evaluation at its end, sat there for up to tens of seconds
  after its checkpoint was saved, and a multiworker run's peers waited at the final
  barrier (tests/test_faults_runs.py, 'save' and 'summaries').
  """
  options = tf.data.Options()
  options.autotune.enabled = False
  return dataset.prefetch(tf.data.AUTOTUNE).with_options(options)


def inputs(eval_data, data_dir, batch_size):
  """Evaluation batches: every record of the files exactly once, in order.

  Args:
    eval_data: bool, True for test_batch.bin, False for the training files.
    data_dir: str, holds cifar-10-batches-bin/.
    batch_size: int, images per batch; the final batch may be smaller.

  Returns:
    tf.data.Dataset of (images float32 [b, 24, 24, 3], labels int32 [b]),
    b = batch_size except possibly for the last batch.

  Raises:
    common.cifar10_format.DataError: a file is missing or malformed.
  """
  filenames = fmt.eval_files(data_dir) if eval_data else fmt.train_files(data_dir)
  fmt.num_examples(filenames)  # fail early, naming a truncated file
  dataset = tf.data.FixedLengthRecordDataset(filenames, fmt.RECORD_BYTES).map(
      _eval_example, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
  # Deviation from upstream: evaluation counts every test record exactly once.
  # Upstream ran ceil(n / batch) full batches from a
  # looping queue, counting some test images twice; the final batch here is
  # partial, so each record counts exactly once.
  return _without_autotuning(dataset.batch(batch_size))
