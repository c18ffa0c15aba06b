"""Precision @ 1 of the moving-average model on the test set (upstream cifar10_eval.py).

Deviation from upstream: every test record is counted exactly once. Upstream
ran ceil(n / batch) full batches from an endlessly cycling queue, so the last
batch wrapped around and counted up to batch - 1 records twice; here the input
stops after one epoch and the last batch is smaller.
"""

import tensorflow.compat.v1 as tf

from cifar10_towers.common import hparams
from cifar10_towers.legacy import inputs
from cifar10_towers.legacy import model
from cifar10_towers.runtime import checkpoints
from cifar10_towers.runtime import evaluation


def evaluate_contents(contents, data_dir, batch_size=hparams.BATCH_SIZE,
                      num_examples=None, should_stop=None, progress=None):
  """Counts the correct top-1 predictions of a checkpoint's averaged model.

  What `runtime.evaluation.run` calls for a legacy checkpoint (modern/eval.py
  has the same function).

  Args:
    contents: runtime.checkpoints.Contents of a legacy checkpoint, read
      (`runtime.checkpoints.read`) and checked before any graph is built.
    data_dir: str, directory holding `cifar-10-batches-bin/test_batch.bin`.
    batch_size: int, images per evaluation batch.
    num_examples: optional int >= 1, evaluate the first this many test
      records (in file order); None or more than the file holds means all.
    should_stop: optional callable() -> bool, asked between batches.
    progress: optional callable(records_done), called after each batch.

  Returns:
    runtime.evaluation.EvalCounts, or None when should_stop() turned true first.

  Raises:
    common.cifar10_format.DataError: the test file is missing or malformed.
    runtime.evaluation.EvalError: the checkpoint is a modern one, or does not
      hold this model's moving averages.
  """
  with tf.Graph().as_default() as graph:
    # One epoch in file order, the last batch smaller.
    images, labels = inputs.inputs(True, data_dir, batch_size)
    logits = model.inference(images)
    top_k_op = tf.nn.in_top_k(logits, labels, 1)

    # Restore the moving-average (shadow) value of each variable into it.
    variable_averages = tf.train.ExponentialMovingAverage(
        hparams.MOVING_AVERAGE_DECAY)
    values = evaluation.moving_averages(contents, checkpoints.LEGACY,
                                        variable_averages.variables_to_restore())
    # The epoch counter of the input is a local variable.
    local_init = tf.local_variables_initializer()
    close_queues = inputs.close_queue_ops()
    graph.finalize()

    with tf.Session() as sess:
      sess.run(local_init)
      # Deviation from upstream: a Saver restored from the files; here the
      # values were read (and their checksums checked) before the graph was
      # built, so a checkpoint the trainer deletes meanwhile is still whole.
      for variable, value in values:
        variable.load(value, sess)

      def batches():
        try:
          while not coord.should_stop():
            yield sess.run(top_k_op)
        except tf.errors.OutOfRangeError:
          pass  # the epoch is over: every record was seen once

      coord = tf.train.Coordinator()
      threads = tf.train.start_queue_runners(sess, coord)
      try:
        return evaluation.count_correct(batches(), data_dir, num_examples, contents,
                                        should_stop, progress)
      finally:
        inputs.stop_queue_threads(sess, coord, threads, close_queues)

