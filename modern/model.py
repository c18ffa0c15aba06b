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


def _variable_on_cpu(name, initial_value, trainable=True):
  """A float32 variable on the variables' device (upstream's helper)."""
  with tf.device(devices.VARIABLE_DEVICE):
    return tf.Variable(initial_value, name=name, trainable=trainable)  # float32 initial values


class _Layers(tf.Module):
  """One node per layer, an attribute named like the layer (a node of the
  checkpoint graph), holding that layer's `weights` and `biases`."""

  def __init__(self, name, variable):
    """variable: callable(LayerSpec, 'weights' or 'biases') -> tf.Variable."""
    super().__init__(name=name)
    # Variables are created outside self.name_scope so that their names are
    # exactly legacy's ('conv1/weights:0'), with no module prefix.
    for layer in model_spec.LAYERS:
      node = tf.Module(name=layer.name)
      node.weights, node.biases = (variable(layer, kind) for kind in ('weights', 'biases'))
      setattr(self, layer.name, node)

  def variables_by_name(self):
    """Dict 'conv1/weights' -> tf.Variable, in upstream's (VARIABLE_NAMES) order."""
    return {name: getattr(getattr(self, layer), kind)
            for name in model_spec.VARIABLE_NAMES for layer, kind in [name.split('/')]}

  def variable_list(self):
    """The variables as a list, in VARIABLE_NAMES order."""
    return list(self.variables_by_name().values())


def _initial_variable(layer, kind):
  """Upstream's initializers on `VARIABLE_DEVICE` (the initial values too): weights
  truncated normal with the layer's stddev (tf.random global seed), biases the
  layer's constant."""
  with tf.device(devices.VARIABLE_DEVICE):
    initial = (tf.random.truncated_normal(layer.weight_shape, stddev=layer.stddev)
               if kind == 'weights' else tf.fill([layer.weight_shape[-1]], layer.bias_init))
  return _variable_on_cpu(f'{layer.name}/{kind}', initial)


class Cifar10Model(_Layers):
  """The 10 trainable variables of docs/equivalence.md §1 and the forward pass over them.

  Attributes:
    conv1, conv2, local3, local4, softmax_linear: nodes holding `weights`
      and `biases`.
  """

  def __init__(self, lrn=None):
    """Creates the variables (`_initial_variable`).

    Args:
      lrn: optional callable computing the local response normalization
        (`common.lrn.for_plan`); default upstream's `tf.nn.lrn`.
    """
    super().__init__('cifar10_model', _initial_variable)
    self._lrn = lrn

  def params(self, values=None):
    """The `params` dict of `model_spec.forward`.

    Args:
      values: optional list of tensors in VARIABLE_NAMES order (e.g. the
        variables' values read once and sent to a tower); default: the
        variables themselves.

    Returns:
      dict layer name -> (weights, biases).
    """
    values = values or self.variable_list()
    return {layer.name: tuple(values[2 * i:2 * i + 2])
            for i, layer in enumerate(model_spec.LAYERS)}

  def inference(self, images, params=None, activation_hook=None):
    """Builds the CIFAR-10 model (upstream `inference`).

    Args:
      images: float32 [batch, 24, 24, 3].
      params: optional dict from `params(values)`; default the variables.
      activation_hook: optional callable(tensor) given each layer's output.

    Returns:
      logits: float32 [batch, 10].
    """
    return model_spec.forward(images, params or self.params(), activation_hook, self._lrn)

  def loss_terms(self, logits, labels, params=None):
    """The terms of `loss`: each weight decay, then the mean cross-entropy.

    In upstream's collection order (weight decays were added during
    inference, the cross-entropy last), so that even the sum's rounding
    matches legacy's.
    """
    params = params or self.params()
    return [model_spec.weight_decay(params[layer.name][0], layer.wd)
            for layer in model_spec.LAYERS if layer.wd is not None] + [
                model_spec.cross_entropy_mean(logits, labels)]

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
    return tf.add_n(self.loss_terms(logits, labels, params), name='total_loss')


class MovingAverages(_Layers):
  """Shadow variables of the trainable variables (legacy's ExponentialMovingAverage).

  Same object structure as `Cifar10Model` (`ema.conv1.weights`, ...), so a
  `Cifar10Model` can stand in for it to restore the averages (see `eval.py`).
  The step updates them (modern.step.TrainState.apply_gradients).
  """

  def __init__(self, model):
    """Creates one shadow per variable of `model`, holding its current value.

    Like legacy's `ExponentialMovingAverage.apply`, which initializes each
    shadow with the variable's initial value.
    """
    super().__init__('moving_averages', lambda layer, kind: _variable_on_cpu(
        model_spec.average_name(f'{layer.name}/{kind}'),
        model.variables_by_name()[f'{layer.name}/{kind}'].read_value(), trainable=False))
