"""modern.model: the variables' names, shapes, placement, initializers, and the loss."""

import numpy as np
import pytest
import tensorflow as tf

from cifar10_towers.common import model_spec
from cifar10_towers.modern import model as model_lib


@pytest.fixture(scope='module')
def model():
  tf.random.set_seed(0)
  return model_lib.Cifar10Model()


def test_variable_names_shapes_and_count(model):
  by_name = model.variables_by_name()
  assert list(by_name) == list(model_spec.VARIABLE_NAMES)
  assert [v.name for v in by_name.values()] == [
      n + ':0' for n in model_spec.VARIABLE_NAMES]
  for name, var in by_name.items():
    assert tuple(var.shape) == tuple(model_spec.variable_shape(name))
    assert var.dtype == tf.float32 and var.trainable
  assert len(model.trainable_variables) == 10
  assert sum(int(np.prod(v.shape)) for v in model.trainable_variables) == 1068298


def test_variables_live_on_the_cpu(model):
  for var in model.trainable_variables:
    assert tf.DeviceSpec.from_string(var.device).device_type == 'CPU'
    assert tf.DeviceSpec.from_string(var.device).device_index == 0


def test_initializers(model):
  for layer in model_spec.LAYERS:
    weights = getattr(model, layer.name).weights.numpy()
    biases = getattr(model, layer.name).biases.numpy()
    np.testing.assert_array_equal(biases, np.full(biases.shape, layer.bias_init,
                                                  np.float32))
    # Truncated normal: nothing beyond 2 stddev, and the std of a normal
    # truncated at +-2 sigma is 0.8796 sigma.
    assert np.abs(weights).max() <= 2 * layer.stddev * (1 + 1e-6)
    if weights.size >= 4096:
      assert abs(weights.std() / layer.stddev - 0.8796) < 0.05, layer.name
      assert abs(weights.mean()) < 0.05 * layer.stddev, layer.name


def test_loss_is_cross_entropy_plus_weight_decay_once(model):
  rng = np.random.default_rng(1)
  images = rng.standard_normal((6, 24, 24, 3)).astype(np.float32)
  labels = np.array([0, 1, 2, 3, 9, 5], np.int32)
  logits = model.inference(images).numpy().astype(np.float64)
  assert logits.shape == (6, 10)
  log_softmax = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(
      1, keepdims=True)) - logits.max(1, keepdims=True)
  cross_entropy = -log_softmax[np.arange(6), labels].mean()
  decay = sum(0.004 * (getattr(model, name).weights.numpy().astype(np.float64) ** 2
                       ).sum() / 2 for name in ('local3', 'local4'))
  loss = float(model.loss(model.inference(images), labels))
  np.testing.assert_allclose(loss, cross_entropy + decay, rtol=1e-6)
  # The weight decay is a large, visible part of the loss at initialization.
  assert decay > 1.0


def test_params_values_give_the_same_logits(model):
  images = np.random.default_rng(2).standard_normal((3, 24, 24, 3)).astype(np.float32)
  values = [tf.identity(v) for v in model.variable_list()]
  np.testing.assert_array_equal(model.inference(images, model.params(values)).numpy(),
                                model.inference(images).numpy())
