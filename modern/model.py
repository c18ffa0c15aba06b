"""The CIFAR-10 model as a `tf.Module`: variables, `inference` and `loss`.

The arithmetic (layers, initializers, loss terms) is `common.model_spec`,
shared with legacy; this file only owns the variables, the TF2 way.

Object layout (it is also the checkpoint layout, see `modern.checkpoints`):
`model.conv1.weights`, `model.conv1.biases`, ..., `model.softmax_linear.biases`,
each a `tf.Variable` named like legacy's, e.g. `conv1/weights:0`.
"""

import tensorflow as tf

from cifar10_towers.common import devices
from cifar10_towers.common import model_spec


class LayerVariables(tf.Module):
  """The `weights` and `biases` of one layer (a node of the checkpoint graph)."""

  def __init__(self, layer_name, weights, biases):
    """Wraps existing variables.

    Args:
      layer_name: str, e.g. 'conv1'.
      weights: tf.Variable of the layer's weight shape.
      biases: tf.Variable [out_dim].
    """
    super().__init__(name=layer_name)
    self.weights = weights
    self.biases = biases


def _variable_on_cpu(name, initial_value):
  """A trainable float32 variable on the variables' device (upstream's helper)."""
  with tf.device(devices.VARIABLE_DEVICE):
    return tf.Variable(initial_value, name=name, dtype=tf.float32, trainable=True)


class Cifar10Model(tf.Module):
  """The 10 trainable variables of docs/equivalence.md §1 and the forward pass over them.

  Attributes:
    conv1, conv2, local3, local4, softmax_linear: `LayerVariables`.
  """

  def __init__(self, name='cifar10_model', lrn=None):
    """Creates the variables with upstream's initializers on `VARIABLE_DEVICE`.

    Weights: truncated normal with the layer's stddev (tf.random global seed);
    biases: the layer's constant.

    Args:
      name: the module's name.
      lrn: optional callable computing the local response normalization
        (`common.lrn.for_plan`); default upstream's `tf.nn.lrn`.
    """
    super().__init__(name=name)
    self._lrn = lrn
    # Variables are created outside self.name_scope so that their names are
    # exactly legacy's ('conv1/weights:0'), with no module prefix.
    for layer in model_spec.LAYERS:
      with tf.device(devices.VARIABLE_DEVICE):
        weights_init = tf.random.truncated_normal(
            layer.weight_shape, stddev=layer.stddev, dtype=tf.float32)
        biases_init = tf.fill([layer.weight_shape[-1]],
                              tf.constant(layer.bias_init, tf.float32))
      weights = _variable_on_cpu(layer.name + '/weights', weights_init)
      biases = _variable_on_cpu(layer.name + '/biases', biases_init)
      setattr(self, layer.name, LayerVariables(layer.name, weights, biases))

  def variables_by_name(self):
    """Dict 'conv1/weights' -> tf.Variable, in upstream's (VARIABLE_NAMES) order."""
    return {name: getattr(getattr(self, name.split('/')[0]), name.split('/')[1])
            for name in model_spec.VARIABLE_NAMES}

  def variable_list(self):
    """The trainable variables as a list, in VARIABLE_NAMES order."""
    return list(self.variables_by_name().values())

  def params(self, values=None):
    """The `params` dict of `model_spec.forward`.

    Args:
      values: optional list of tensors in VARIABLE_NAMES order (e.g. the
        variables' values read once and sent to a tower); default: the
        variables themselves.

    Returns:
      dict layer name -> (weights, biases).
    """
    if values is None:
      values = self.variable_list()
    if len(values) != len(model_spec.VARIABLE_NAMES):
      raise ValueError('expected %d parameter values, got %d'
                       % (len(model_spec.VARIABLE_NAMES), len(values)))
    by_name = dict(zip(model_spec.VARIABLE_NAMES, values))
    return {layer.name: (by_name[layer.name + '/weights'],
                         by_name[layer.name + '/biases'])
            for layer in model_spec.LAYERS}

  def inference(self, images, params=None):
    """Builds the CIFAR-10 model (upstream `inference`).

    Args:
      images: float32 [batch, 24, 24, 3].
      params: optional dict from `params(values)`; default the variables.

    Returns:
      logits: float32 [batch, 10].
    """
    return model_spec.forward(images, params or self.params(), lrn=self._lrn)

  def __call__(self, images):
    """Logits float32 [batch, 10] of images float32 [batch, 24, 24, 3]."""
    return self.inference(images)

  def loss(self, logits, labels, params=None):
    """Total loss of one tower: mean cross-entropy + weight decay (upstream `loss`).

    Upstream adds each weight-decay term to the 'losses' collection and sums
    the collection; here the terms are summed directly, once per call, so a
    tower's loss holds each term exactly once.

    Args:
      logits: float32 [batch, 10].
      labels: int [batch].
      params: optional dict from `params(values)`; default the variables.

    Returns:
      float32 scalar.
    """
    params = params or self.params()
    # Summed in upstream's collection order (weight decays were added during
    # inference, the cross-entropy last), so even the rounding matches.
    terms = [model_spec.weight_decay(params[layer.name][0], layer.wd)
             for layer in model_spec.LAYERS if layer.wd is not None]
    terms.append(model_spec.cross_entropy_mean(logits, labels))
    return tf.add_n(terms, name='total_loss')


class MovingAverages(tf.Module):
  """Shadow variables of the trainable variables (legacy's ExponentialMovingAverage).

  Same object structure as `Cifar10Model` (`ema.conv1.weights`, ...), so a
  `Cifar10Model` can stand in for it to restore the averages (see `eval.py`).
  """

  def __init__(self, model):
    """Creates one shadow per variable of `model`, holding its current value.

    Like legacy's `ExponentialMovingAverage.apply`, which initializes each
    shadow with the variable's initial value.
    """
    super().__init__(name='moving_averages')
    for layer in model_spec.LAYERS:
      source = getattr(model, layer.name)
      shadows = []
      for kind in ('weights', 'biases'):
        var = getattr(source, kind)
        with tf.device(devices.VARIABLE_DEVICE):
          shadows.append(tf.Variable(
              var.read_value(), trainable=False,
              name='%s/%s/%s' % (layer.name, kind, model_spec.EMA_SUFFIX)))
      setattr(self, layer.name, LayerVariables(layer.name, *shadows))

  def variables_by_name(self):
    """Dict 'conv1/weights' -> shadow tf.Variable, in VARIABLE_NAMES order."""
    return {name: getattr(getattr(self, name.split('/')[0]), name.split('/')[1])
            for name in model_spec.VARIABLE_NAMES}

  def apply(self, model, decay):
    """shadow -= (shadow - variable) * (1 - decay), for every variable.

    Args:
      model: Cifar10Model whose current (already updated) values are averaged.
      decay: float32 scalar tensor, `model_spec.ema_decay(global_step)`.
    """
    one_minus_decay = 1.0 - decay
    shadows = self.variables_by_name()
    for name, var in model.variables_by_name().items():
      # The operand order of legacy's assign_moving_average.
      shadows[name].assign_sub((shadows[name] - var) * one_minus_decay)
