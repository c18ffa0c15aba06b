"""The CIFAR-10 model as TF1 variables and collections (upstream cifar10.py).

The layer table and the forward arithmetic are `common.model_spec`, shared
with the modern trainer; this module creates the variables the TF1 way
(`variable_scope`, `get_variable` on the CPU) and keeps upstream's 'losses'
collection, from which each tower sums its own loss terms.
"""

import re

import tensorflow.compat.v1 as tf

from cifar10_towers.common import devices
from cifar10_towers.common import hparams
from cifar10_towers.common import model_spec
from cifar10_towers.common import tags

TOWER_NAME = hparams.TOWER_NAME
LOSSES_COLLECTION = 'losses'  # upstream's collection of per-tower loss terms


def scalar_summary(tag, value):
  """A scalar summary op written under exactly `tag`, added to SUMMARIES.

  `tf.summary.scalar` tags by its name scope, which TF uniquifies ('_1')
  when an op of that name exists already (e.g. 'tower_0/total_loss'); the
  raw op takes the tag as a value, so both trainers' tags read the same
  (`common.tags.summary_tags`).
  """
  return collected(tf.raw_ops.ScalarSummary(tags=tag, values=value, name='scalar_summary'))


def histogram_summary(tag, values):
  """A histogram summary op written under exactly `tag`, added to SUMMARIES."""
  return collected(tf.raw_ops.HistogramSummary(tag=tag, values=values,
                                                name='histogram_summary'))


def collected(op):
  tf.add_to_collection(tf.GraphKeys.SUMMARIES, op)
  return op


def _activation_summary(x):
  """Adds a histogram and a sparsity summary of one layer's output.

  Tagged 'tower_N/<layer>/activations' and '.../sparsity' inside a tower,
  '<layer>/activations' outside one.

  Args:
    x: float32 tensor, a layer's activations.
  """
  # The layer's name without the '_1' TF adds because the layer's variable
  # scope already took its name; the prefix is the tower's name scope.
  # Deviation from upstream: every tower's loss summary is written.
  # And its activations, each under its own tag.
  prefix, _, layer = x.op.name.rpartition('/')
  layer = re.sub(r'_\d+$', '', layer)
  histogram_summary(tags.activations_tag(prefix, layer), x)
  scalar_summary(tags.sparsity_tag(prefix, layer), tf.nn.zero_fraction(x))


def _variable_on_cpu(name, shape, initializer):
  """Creates (or, with reuse, gets) a variable on the variables' device.

  Args:
    name: str, the variable's name inside the current variable scope.
    shape: sequence of ints.
    initializer: an initializer.

  Returns:
    a float32 variable on `common.devices.VARIABLE_DEVICE` ('/cpu:0').
  """
  with tf.device(devices.VARIABLE_DEVICE):
    return tf.get_variable(name, shape, tf.float32, initializer)


def _variable_with_weight_decay(name, shape, stddev, wd):
  """A truncated-normal variable whose weight decay is added to 'losses'.

  The decay term is built where this runs, so inside a tower it is named
  `tower_N/<layer>/weight_loss` and `tower_loss` finds it by its scope.

  Args:
    name: str, the variable's name.
    shape: sequence of ints.
    stddev: float, standard deviation of the truncated normal.
    wd: float or None; when set, `wd * l2_loss(var)` is added to the
      'losses' collection.

  Returns:
    the variable.
  """
  var = _variable_on_cpu(name, shape, tf.truncated_normal_initializer(stddev=stddev))
  if wd is not None:
    tf.add_to_collection(LOSSES_COLLECTION, model_spec.weight_decay(var, wd))
  return var


def inference(images, lrn=None):
  """Builds the CIFAR-10 model.

  Creates the 10 variables of `common.model_spec.LAYERS` (`conv1/weights`,
  ... `softmax_linear/biases`) in the first call of a graph; later calls
  under a reusing variable scope share them.

  Args:
    images: float32 [batch, 24, 24, 3], from `distorted_inputs` or `inputs`.
    lrn: optional callable computing the local response normalization
      (`common.lrn.for_plan`); default upstream's `tf.nn.lrn`.

  Returns:
    logits: float32 [batch, NUM_CLASSES], unscaled.
  """
  params = {}
  for layer in model_spec.LAYERS:
    with tf.variable_scope(layer.name):
      params[layer.name] = (
          _variable_with_weight_decay('weights', layer.weight_shape, layer.stddev, layer.wd),
          _variable_on_cpu('biases', layer.weight_shape[-1:],
                           tf.constant_initializer(layer.bias_init)))
  return model_spec.forward(images, params, _activation_summary, lrn)


def loss(logits, labels):
  """Adds the mean cross-entropy to 'losses'; returns the sum of 'losses'.

  Args:
    logits: float32 [batch, NUM_CLASSES], from `inference`.
    labels: int [batch].

  Returns:
    float32 scalar, the sum of every term in the 'losses' collection (the
    whole graph's: a multi-tower graph filters by scope, see
    `legacy.train.tower_loss`).
  """
  tf.add_to_collection(LOSSES_COLLECTION,
                       model_spec.cross_entropy_mean(logits, labels))
  # The total loss is the cross entropy plus all of the weight decay terms.
  return tf.add_n(tf.get_collection(LOSSES_COLLECTION), name='total_loss')
