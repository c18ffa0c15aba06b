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


EvalError = evaluation.EvalError  # one class, common to both evaluators


def eval_once(checkpoint_path, data_dir, batch_size=hparams.BATCH_SIZE,
              num_examples=None):
  """Counts the correct top-1 predictions of one checkpoint's averaged model.

  Args:
    checkpoint_path: str, a checkpoint prefix such as `.../model.ckpt-1000`.
    data_dir: str, directory holding `cifar-10-batches-bin/test_batch.bin`.
    batch_size: int, images per evaluation batch.
    num_examples: optional int >= 1, evaluate the first this many test
      records (in file order); None or more than the file holds means all.

  Returns:
    runtime.evaluation.EvalCounts.

  Raises:
    common.cifar10_format.DataError: the test file is missing or malformed.
    EvalError: the checkpoint cannot be read, is a modern one, or does not
      hold this model's moving averages.
  """
  return evaluate_contents(evaluation.read(checkpoint_path), data_dir, batch_size,
                           num_examples)


def evaluate_contents(contents, data_dir, batch_size=hparams.BATCH_SIZE,
                      num_examples=None, should_stop=None, progress=None):
  """`eval_once` of a checkpoint already read (`runtime.checkpoints.read`).

  Args:
    contents: runtime.checkpoints.Contents of a legacy checkpoint.
    data_dir, batch_size, num_examples: as `eval_once`.
    should_stop: optional callable() -> bool, asked between batches.
    progress: optional callable(records_done), called after each batch.

  Returns:
    EvalCounts, or None when should_stop() turned true first.

  Raises:
    As `eval_once`.
  """
  with tf.Graph().as_default() as graph:
    # One epoch in file order (one reader thread), the last batch smaller.
    images, labels = inputs.inputs(eval_data=True, data_dir=data_dir,
                                   batch_size=batch_size, num_epochs=1,
                                   num_threads=1)
    logits = model.inference(images)
    top_k_op = tf.nn.in_top_k(logits, labels, 1)

    # Restore the moving-average (shadow) value of each variable into it.
    variable_averages = tf.train.ExponentialMovingAverage(
        hparams.MOVING_AVERAGE_DECAY)
    variables_to_restore = variable_averages.variables_to_restore()
    values = evaluation.moving_averages(
        contents, checkpoints.LEGACY,
        {key: v.shape.as_list() for key, v in variables_to_restore.items()})
    # The epoch counter of the input is a local variable.
    local_init = tf.local_variables_initializer()
    close_queues = inputs.close_queue_ops()
    graph.finalize()

    with tf.Session() as sess:
      sess.run(local_init)
      # Deviation from upstream: a Saver restored from the files; here the
      # values were read (and their checksums checked) before the graph was
      # built, so a checkpoint the trainer deletes meanwhile is still whole.
      for key, variable in variables_to_restore.items():
        variable.load(values[key], sess)

      def batches():
        try:
          while not coord.should_stop():
            yield sess.run(top_k_op)
        except tf.errors.OutOfRangeError:
          pass  # the epoch is over: every record was seen once

      coord = tf.train.Coordinator()
      threads = tf.train.start_queue_runners(sess=sess, coord=coord)
      try:
        return evaluation.count_correct(batches(), data_dir, num_examples,
                                        checkpoints.global_step(contents), should_stop,
                                        progress)
      finally:
        inputs.stop_queue_threads(sess, coord, threads, close_queues)


def evaluate(checkpoint_dir, data_dir, batch_size=hparams.BATCH_SIZE,
             num_examples=None, eval_dir=None):
  """Evaluates the newest intact checkpoint of checkpoint_dir once.

  Args:
    checkpoint_dir: str, the train_dir of `legacy.train.train`.
    data_dir, batch_size, num_examples: as `eval_once`.
    eval_dir: optional str; when set, a 'Precision @ 1' summary is written
      there for TensorBoard (`runtime.evaluation.PrecisionWriter`).

  Returns:
    (precision, global_step): float in [0, 1], int.

  Raises:
    EvalError: checkpoint_dir has no intact checkpoint, or it does not fit.
    common.cifar10_format.DataError: the test file is missing or malformed.
    runtime.evaluation.EvalDirError: eval_dir cannot be written.
  """
  return evaluation.evaluate_newest(
      checkpoint_dir,
      lambda contents: evaluate_contents(contents, data_dir, batch_size, num_examples),
      'legacy', eval_dir)


def evaluate_loop(checkpoint_dir, data_dir, batch_size=hparams.BATCH_SIZE,
                  num_examples=None, eval_dir=None, interval_secs=300, max_evals=None):
  """Evaluates each new checkpoint of checkpoint_dir once, as it appears.

  Looks every `interval_secs` seconds until a stop signal (or until
  `max_evals` checkpoints were evaluated); see `runtime.evaluation.run`.

  Args:
    checkpoint_dir, data_dir, batch_size, num_examples, eval_dir: as for `evaluate`.
    interval_secs: float, seconds between looks at checkpoint_dir.
    max_evals: optional int, stop after this many evaluations.

  Returns:
    list of (precision, global_step), one per checkpoint evaluated.
  """
  return evaluation.evaluate_each(
      checkpoint_dir,
      lambda contents, should_stop: evaluate_contents(
          contents, data_dir, batch_size, num_examples, should_stop),
      interval_secs, max_evals, eval_dir)
