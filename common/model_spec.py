"""The network both trainers build: variables, initializers, forward pass, loss terms.

Each trainer creates the variables its own way (legacy: `tf.compat.v1`
variable scopes on `/cpu:0`; modern: `tf.Variable`s in a `tf.Module`) from
`LAYERS`, and both compute the logits with `forward`, so the arithmetic is
written once.
"""

import collections

import tensorflow as tf

from cifar10_towers.common import hparams
from cifar10_towers.common import lrn as lrn_lib

LayerSpec = collections.namedtuple('LayerSpec', 'name weight_shape stddev wd bias_init')

# Flattened size of pool2: 24 -> 12 -> 6 spatially, 64 channels.
FLAT_DIM = (hparams.IMAGE_SIZE // 4) ** 2 * 64  # 2304

LAYERS = (
    LayerSpec('conv1', (5, 5, 3, 64), 5e-2, None, 0.0),
    LayerSpec('conv2', (5, 5, 64, 64), 5e-2, None, 0.1),
    LayerSpec('local3', (FLAT_DIM, 384), 0.04, 0.004, 0.1),
    LayerSpec('local4', (384, 192), 0.04, 0.004, 0.1),
    LayerSpec('softmax_linear', (192, hparams.NUM_CLASSES), 1 / 192.0, None, 0.0),
)
LAYERS_BY_NAME = {layer.name: layer for layer in LAYERS}

# The 10 trainable variables, in upstream's order: conv1/weights, conv1/biases, ...
VARIABLE_NAMES = tuple(f'{layer.name}/{kind}'
                       for layer in LAYERS for kind in ('weights', 'biases'))
NUM_PARAMETERS = 1068298


def average_name(variable_name):
  """A variable's moving average (shadow): 'conv1/weights/ExponentialMovingAverage'."""
  return f'{variable_name}/ExponentialMovingAverage'


def variable_shape(name):
  """Shape of a variable named like 'local3/weights'."""
  layer_name, kind = name.split('/')
  shape = LAYERS_BY_NAME[layer_name].weight_shape
  return shape if kind == 'weights' else shape[-1:]


def _max_pool(x, name):
  # An int window and stride mean [1, k, k, 1] (NHWC).
  return tf.nn.max_pool2d(x, hparams.POOL_KSIZE, hparams.POOL_STRIDE, 'SAME', name=name)


def forward(images, params, activation_hook=None, lrn=None):
  """The CIFAR-10 model of upstream `inference`, given its variables.

  Args:
    images: float32 [batch, 24, 24, 3].
    params: dict layer name -> (weights, biases) tensors or variables.
    activation_hook: optional callable(tensor) called with each layer's output
      (legacy uses it for activation summaries).
    lrn: optional callable(x) computing upstream's local response
      normalization (e.g. `common.lrn.fast_lrn`); default upstream's op.

  Returns:
    logits: float32 [batch, NUM_CLASSES], unscaled (no softmax).
  """
  def normalize(x, name):
    with tf.name_scope(name):
      return (lrn or lrn_lib.upstream_lrn)(x)

  def layer(x, name, relu=True):
    """conv1, conv2 (SAME, stride 1) or a fully connected layer, then ReLU."""
    weights, biases = params[name]
    if len(weights.shape) == 4:
      x = tf.nn.bias_add(tf.nn.conv2d(x, weights, 1, 'SAME'), biases)
    else:
      x = tf.add(tf.matmul(x, weights), biases)
    out = (tf.nn.relu if relu else tf.identity)(x, name=name)
    if activation_hook:
      activation_hook(out)
    return out

  pool1 = _max_pool(layer(images, 'conv1'), 'pool1')
  conv2 = layer(normalize(pool1, 'norm1'), 'conv2')
  # Upstream normalizes before pooling in the second block.
  pool2 = _max_pool(normalize(conv2, 'norm2'), 'pool2')
  local4 = layer(layer(tf.reshape(pool2, [-1, FLAT_DIM]), 'local3'), 'local4')
  return layer(local4, 'softmax_linear', relu=False)


def cross_entropy_mean(logits, labels):
  """Mean sparse softmax cross-entropy of one batch.

  Args:
    logits: float32 [batch, NUM_CLASSES].
    labels: int [batch].

  Returns:
    float32 scalar.
  """
  cross_entropy = tf.nn.sparse_softmax_cross_entropy_with_logits(
      labels=tf.cast(labels, tf.int64), logits=logits, name='cross_entropy_per_example')
  return tf.reduce_mean(cross_entropy, name='cross_entropy')


def weight_decay(weights, wd):
  """`wd * l2_loss(weights)`, with l2_loss = sum(w**2) / 2."""
  return tf.multiply(tf.nn.l2_loss(weights), wd, name='weight_loss')


def learning_rate(global_step, decay_steps, initial=hparams.INITIAL_LEARNING_RATE):
  """Upstream's staircase exponential decay, as a plain formula.

  lr = initial * LEARNING_RATE_DECAY_FACTOR ** floor(step / decay_steps)
  (what `tf.compat.v1.train.exponential_decay(..., staircase=True)` computes);
  `initial` is upstream's INITIAL_LEARNING_RATE unless --learning_rate says
  otherwise.
  """
  return initial * tf.pow(hparams.LEARNING_RATE_DECAY_FACTOR,
                          tf.floor(tf.cast(global_step, tf.float32) / float(decay_steps)))


def ema_decay(num_updates):
  """Decay of the weights' moving average at `num_updates` (the global step).

  `tf.train.ExponentialMovingAverage(MOVING_AVERAGE_DECAY, num_updates)` uses
  min(decay, (1 + n) / (10 + n)); each update is
  shadow -= (1 - decay) * (shadow - variable).
  """
  n = tf.cast(num_updates, tf.float32)
  return tf.minimum(hparams.MOVING_AVERAGE_DECAY, (1.0 + n) / (10.0 + n))
