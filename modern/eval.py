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


def moving_average_model(contents):
  """A Cifar10Model holding the moving averages in `contents` (runtime.checkpoints.Contents)."""
  model = model_lib.Cifar10Model()
  # The shadow (moving-average) value of each variable goes into the variable,
  # as upstream eval's `variables_to_restore()`; the raw weights are not used.
  for variable, value in evaluation.moving_averages(contents, checkpoints.MODERN, {
      ckpt_lib.checkpoint_key(model_spec.average_name(name)): variable
      for name, variable in model.variables_by_name().items()}):
    variable.assign(value)
  return model


def evaluate_contents(contents, data_dir, batch_size=hparams.BATCH_SIZE,
                      num_examples=None, should_stop=None, progress=None):
  """Counts the correct top-1 predictions of a checkpoint's averaged model.

  What `runtime.evaluation.run` calls for a modern checkpoint (legacy/eval.py
  has the same function).

  Args:
    contents: runtime.checkpoints.Contents of a modern checkpoint.
    data_dir: str, holds cifar-10-batches-bin/test_batch.bin.
    batch_size: int, images per evaluation batch.
    num_examples: optional int, evaluate only the first this many test
      records; default every record, each exactly once.
    should_stop: optional callable() -> bool, asked between batches.
    progress: optional callable(records_done), called after each batch.

  Returns:
    runtime.evaluation.EvalCounts, or None when should_stop() turned true
    first.

  Raises:
    runtime.evaluation.EvalError: the checkpoint lacks the moving averages,
      or is a legacy one.
    common.cifar10_format.DataError: the test file is missing or malformed.
  """
  model = moving_average_model(contents)

  @tf.function(reduce_retracing=True)  # one more trace, for a smaller last batch
  def correct(images, labels):
    return tf.math.in_top_k(labels, model.inference(images), 1)

  batches = (correct(images, labels).numpy()
             for images, labels in inputs.inputs(True, data_dir, batch_size))
  return evaluation.count_correct(batches, data_dir, num_examples, contents, should_stop,
                                  progress)

