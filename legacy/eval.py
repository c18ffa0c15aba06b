"""Precision @ 1 of the moving-average model on the test set (upstream cifar10_eval.py).

Deviation from upstream: every test record is counted exactly once. Upstream
ran ceil(n / batch) full batches from an endlessly cycling queue, so the last
batch wrapped around and counted up to batch - 1 records twice; here the input
stops after one epoch and the last batch is smaller.
"""

import collections
import datetime
import os
import time

import tensorflow.compat.v1 as tf

from common import checkpoints
from common import cifar10_format
from common import hparams
from legacy import inputs
from legacy import model


EvalCounts = collections.namedtuple('EvalCounts', [
    'true_count',  # records whose top prediction is the label
    'total_count',  # records evaluated, each once
    'global_step',  # global step of the checkpoint
])


class EvalError(Exception):
  """Evaluation cannot run; the message says why and what to do."""


def _checkpoint_reader(checkpoint_path):
  """A reader of a TF1 Saver checkpoint; EvalError for anything else."""
  try:
    reader = tf.train.NewCheckpointReader(checkpoint_path)
  except (tf.errors.NotFoundError, tf.errors.DataLossError) as e:
    raise EvalError('cannot read checkpoint %s: %s'
                    % (checkpoint_path, e.message.splitlines()[0])) from e
  if reader.has_tensor(checkpoints.OBJECT_GRAPH_KEY):
    # A name-based Saver would fall back to rebuilding itself from the object
    # graph, which fails in a finalized graph; say what it is instead.
    raise EvalError(
        '%s is a modern (tf.train.Checkpoint) checkpoint; evaluate it with '
        'the modern evaluator.' % checkpoint_path)
  return reader


def _checkpoint_step(reader, checkpoint_path):
  """The global step saved in a checkpoint (or named in its file name)."""
  if reader.has_tensor('global_step'):
    return int(reader.get_tensor('global_step'))
  # Upstream's way: the step is the suffix of `model.ckpt-<step>`.
  suffix = os.path.basename(checkpoint_path).rsplit('-', 1)[-1]
  return int(suffix) if suffix.isdigit() else None


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
    EvalCounts.

  Raises:
    common.cifar10_format.DataError: the test file is missing or malformed.
    EvalError: the checkpoint cannot be read, is a modern one, or does not
      hold this model's moving averages.
  """
  reader = _checkpoint_reader(checkpoint_path)
  available = cifar10_format.num_examples(cifar10_format.eval_files(data_dir))
  if num_examples is not None and num_examples < 1:
    raise ValueError('num_examples must be >= 1, got %d' % num_examples)
  num_examples = min(num_examples or available, available)

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
    saver = tf.train.Saver(variable_averages.variables_to_restore())
    # The epoch counter of the input is a local variable.
    local_init = tf.local_variables_initializer()
    close_queues = [qr.queue.close(cancel_pending_enqueues=True)
                    for qr in tf.get_collection(tf.GraphKeys.QUEUE_RUNNERS)]
    graph.finalize()

    with tf.Session() as sess:
      sess.run(local_init)
      try:
        saver.restore(sess, checkpoint_path)
      except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError) as e:
        raise EvalError(
            '%s does not hold the moving averages of this model (%s). Point '
            '--checkpoint_dir at a train_dir written by `train`.'
            % (checkpoint_path, e.message.splitlines()[0])) from e
      global_step = _checkpoint_step(reader, checkpoint_path)

      coord = tf.train.Coordinator()
      threads = tf.train.start_queue_runners(sess=sess, coord=coord)
      true_count = total_count = 0
      try:
        while total_count < num_examples and not coord.should_stop():
          predictions = sess.run(top_k_op)
          # Only the first num_examples records count.
          predictions = predictions[:num_examples - total_count]
          true_count += int(predictions.sum())
          total_count += len(predictions)
      except tf.errors.OutOfRangeError:
        pass  # the epoch is over: every record was seen once
      finally:
        inputs.stop_queue_threads(sess, coord, threads, close_queues)
  if total_count != num_examples:
    raise EvalError('evaluated %d of %d test records from %s; the input '
                    'ended early.' % (total_count, num_examples, data_dir))
  return EvalCounts(true_count, total_count, global_step)


def _write_precision(eval_dir, precision, global_step):
  """Writes upstream's 'Precision @ 1' summary to eval_dir."""
  # Deviation from upstream: upstream also wrote the model's summaries by
  # running them over one more batch; only the precision is written.
  with tf.Graph().as_default():  # FileWriter refuses eager mode
    writer = tf.summary.FileWriter(eval_dir)
    try:
      summary = tf.Summary()
      summary.value.add(tag='Precision @ 1', simple_value=precision)
      writer.add_summary(summary, global_step)
    finally:
      writer.close()


def evaluate(checkpoint_dir, data_dir, batch_size=hparams.BATCH_SIZE,
             num_examples=None, out=print, eval_dir=None):
  """Evaluates the newest checkpoint of checkpoint_dir once.

  Args:
    checkpoint_dir: str, the train_dir of `legacy.train.train`.
    data_dir: str, directory holding `cifar-10-batches-bin/test_batch.bin`.
    batch_size: int, images per evaluation batch.
    num_examples: optional int, evaluate the first this many test records;
      None means all.
    out: callable taking one line, for the result.
    eval_dir: optional str; when set, a 'Precision @ 1' summary is written
      there for TensorBoard (created if missing).

  Returns:
    (precision, global_step): float in [0, 1], int.

  Raises:
    EvalError: checkpoint_dir has no checkpoint, or it does not fit.
    common.cifar10_format.DataError: the test file is missing or malformed.
  """
  checkpoint_path = tf.train.latest_checkpoint(checkpoint_dir)
  if checkpoint_path is None:
    raise EvalError('No checkpoint found in %s. Train first (`python cli.py '
                    'train --train_dir %s`) or pass the train_dir as '
                    '--checkpoint_dir.' % (checkpoint_dir, checkpoint_dir))
  counts = eval_once(checkpoint_path, data_dir, batch_size, num_examples)
  precision = counts.true_count / counts.total_count
  out('%s: precision @ 1 = %.3f' % (datetime.datetime.now(), precision))
  if eval_dir is not None:
    _write_precision(eval_dir, precision, counts.global_step)
  return precision, counts.global_step


def evaluate_loop(checkpoint_dir, data_dir, batch_size=hparams.BATCH_SIZE,
                  num_examples=None, out=print, eval_dir=None,
                  interval_secs=300, max_evals=None):
  """Evaluates each new checkpoint of checkpoint_dir once, as it appears.

  Polls every `interval_secs` seconds until KeyboardInterrupt (or until
  `max_evals` checkpoints were evaluated).

  Args:
    checkpoint_dir, data_dir, batch_size, num_examples, out, eval_dir: as
      for `evaluate`.
    interval_secs: float, seconds between looks at checkpoint_dir.
    max_evals: optional int, stop after this many evaluations.

  Returns:
    list of (precision, global_step), one per checkpoint evaluated.
  """
  results = []
  last_path = None
  waiting_said = False
  try:
    while max_evals is None or len(results) < max_evals:
      path = tf.train.latest_checkpoint(checkpoint_dir)
      if path is None and not waiting_said:
        out('Waiting for a checkpoint in %s.' % checkpoint_dir)
        waiting_said = True
      if path is not None and path != last_path:
        counts = eval_once(path, data_dir, batch_size, num_examples)
        precision = counts.true_count / counts.total_count
        out('%s: precision @ 1 = %.3f (global step %s)'
            % (datetime.datetime.now(), precision, counts.global_step))
        if eval_dir is not None:
          _write_precision(eval_dir, precision, counts.global_step)
        results.append((precision, counts.global_step))
        last_path = path
        continue
      time.sleep(interval_secs)
  except KeyboardInterrupt:
    out('Stopped evaluating; %d checkpoint(s) evaluated.' % len(results))
  return results
