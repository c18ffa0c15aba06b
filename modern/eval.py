"""Evaluation: precision @ 1 of the moving-average weights over the test set.

Mirrors upstream `cifar10_eval.py`: the shadow (moving-average) variables of
the newest checkpoint are restored *into* the model's variables, and every
test record is classified once.
"""

import tensorflow as tf

from cifar10_towers.common import hparams
from cifar10_towers.common import model_spec
from cifar10_towers.modern import checkpoints as ckpt_lib
from cifar10_towers.modern import inputs
from cifar10_towers.modern import model as model_lib
from cifar10_towers.runtime import checkpoints
from cifar10_towers.runtime import evaluation

EvalError = evaluation.EvalError  # one class, common to both evaluators


def _model_of(contents):
  """A Cifar10Model holding the moving averages in `contents`, and the step."""
  model = model_lib.Cifar10Model()
  # The shadow (moving-average) value of each variable goes into the variable,
  # as upstream eval's `variables_to_restore()`; the raw weights are not used.
  variables = {ckpt_lib.checkpoint_key('%s/%s' % (name, model_spec.EMA_SUFFIX)): variable
               for name, variable in model.variables_by_name().items()}
  values = evaluation.moving_averages(
      contents, checkpoints.MODERN, {key: v.shape.as_list() for key, v in variables.items()})
  for key, variable in variables.items():
    variable.assign(values[key])
  return model, checkpoints.global_step(contents)


def _restore_moving_averages(path):
  """A Cifar10Model holding the moving averages saved at `path`, and the step."""
  return _model_of(evaluation.read(path))


def evaluate_contents(contents, data_dir, batch_size=hparams.BATCH_SIZE,
                      num_examples=None, should_stop=None, progress=None):
  """Counts the correct top-1 predictions of a checkpoint already read.

  Args:
    contents: runtime.checkpoints.Contents of a modern checkpoint.
    data_dir, batch_size, num_examples: as `evaluate`.
    should_stop: optional callable() -> bool, asked between batches.
    progress: optional callable(records_done), called after each batch.

  Returns:
    runtime.evaluation.EvalCounts, or None when should_stop() turned true
    first.

  Raises:
    EvalError: the checkpoint lacks the moving averages, or is a legacy one.
    common.cifar10_format.DataError: the test file is missing or malformed.
  """
  model, global_step = _model_of(contents)
  size = hparams.IMAGE_SIZE

  @tf.function(input_signature=[
      tf.TensorSpec([None, size, size, 3], tf.float32),
      tf.TensorSpec([None], tf.int32)])
  def correct(images, labels):
    return tf.math.in_top_k(labels, model.inference(images), 1)

  batches = (correct(images, labels).numpy()
             for images, labels in inputs.inputs(True, data_dir, batch_size))
  return evaluation.count_correct(batches, data_dir, num_examples, global_step,
                                  should_stop, progress)


def evaluate_checkpoint(path, data_dir, batch_size=hparams.BATCH_SIZE, num_examples=None):
  """Precision @ 1 of the moving averages saved in one checkpoint.

  Args:
    path: str, a checkpoint prefix, e.g. '<train_dir>/model.ckpt-1000'.
    data_dir, batch_size, num_examples: as `evaluate`.

  Returns:
    (precision float, global step int, number of test records evaluated int).

  Raises:
    EvalError: the checkpoint cannot be read or lacks the moving averages.
    common.cifar10_format.DataError: the test file is missing or malformed.
  """
  counts = evaluate_contents(evaluation.read(path), data_dir, batch_size, num_examples)
  return evaluation.log_precision(counts), counts.global_step, counts.total_count


def evaluate(checkpoint_dir, data_dir, batch_size=hparams.BATCH_SIZE, num_examples=None,
             eval_dir=None):
  """Precision @ 1 of the newest intact checkpoint's moving averages on the test set.

  Args:
    checkpoint_dir: str, a modern train_dir (model.ckpt-<step> files).
    data_dir: str, holds cifar-10-batches-bin/test_batch.bin.
    batch_size: int, images per evaluation batch.
    num_examples: optional int, evaluate only the first this many test
      records; default every record, each exactly once.
    eval_dir: optional str; when set, a 'Precision @ 1' summary is written
      there for TensorBoard (`runtime.evaluation.PrecisionWriter`).

  Returns:
    (precision float in [0, 1], global step of the checkpoint int).

  Raises:
    EvalError: no intact (modern) checkpoint in checkpoint_dir.
    common.cifar10_format.DataError: the test file is missing or malformed.
    runtime.evaluation.EvalDirError: eval_dir cannot be written.
  """
  return evaluation.evaluate_newest(
      checkpoint_dir,
      lambda contents: evaluate_contents(contents, data_dir, batch_size, num_examples),
      'modern', eval_dir)


def evaluate_loop(checkpoint_dir, data_dir, batch_size=hparams.BATCH_SIZE, num_examples=None,
                  eval_dir=None, interval_secs=300, max_evals=None):
  """Evaluates each new checkpoint, looking every interval_secs (upstream's loop).

  Runs until a stop signal (or `max_evals` evaluations); waits for the
  first checkpoint instead of failing when there is none yet. See
  `runtime.evaluation.run`.

  Args:
    checkpoint_dir, data_dir, batch_size, num_examples, eval_dir: as `evaluate`.
    interval_secs: float, seconds between looks.
    max_evals: optional int, stop after this many evaluations.

  Returns:
    list of (precision, global_step), one per evaluated checkpoint.
  """
  return evaluation.evaluate_each(
      checkpoint_dir,
      lambda contents, should_stop: evaluate_contents(
          contents, data_dir, batch_size, num_examples, should_stop),
      interval_secs, max_evals, eval_dir)
