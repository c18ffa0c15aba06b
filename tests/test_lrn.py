"""common.lrn: the fast LRN computes upstream's tf.nn.lrn and its gradient."""

import numpy as np
import pytest
import tensorflow as tf

from cifar10_towers.common import devices
from cifar10_towers.common import hparams
from cifar10_towers.common import lrn

# Both sides are float32. Each output sums 9 squares in a different order and
# takes s ** -beta as rsqrt * sqrt(rsqrt) instead of pow: a few ulps, measured
# at most 3.4e-7 of the largest magnitude over the scales below.
REL_TOL = 1e-6


def _rel(a, b):
  return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _value_and_grad(fn, x, g):
  with tf.GradientTape() as tape:
    tape.watch(x)
    y = fn(x)
  return y.numpy(), tape.gradient(y, x, output_gradients=g).numpy()


def _reference(beta):
  return lambda x: tf.nn.local_response_normalization(
      x, depth_radius=hparams.LRN_DEPTH_RADIUS, bias=hparams.LRN_BIAS,
      alpha=hparams.LRN_ALPHA, beta=beta)


@pytest.mark.parametrize('scale', [0.1, 1.0, 10.0, 100.0])
def test_fast_lrn_matches_tf_value_and_gradient(scale):
  rng = np.random.default_rng(0)
  # norm1's shape in a batch of 8; large scales make the normalization bite.
  x = tf.constant(rng.normal(size=[8, 12, 12, 64]).astype(np.float32) * scale)
  g = tf.constant(rng.normal(size=[8, 12, 12, 64]).astype(np.float32))
  y, dx = _value_and_grad(lrn.fast_lrn, x, g)
  y_ref, dx_ref = _value_and_grad(_reference(hparams.LRN_BETA), x, g)
  assert _rel(y, y_ref) <= REL_TOL
  assert _rel(dx, dx_ref) <= REL_TOL
  # The normalization is not a no-op at these scales (else the test is weak).
  if scale >= 10.0:
    assert _rel(y, x.numpy()) > 0.1


@pytest.mark.parametrize('beta', [0.5, 1.0])
def test_other_betas_take_the_pow_path(beta):
  rng = np.random.default_rng(1)
  x = tf.constant(rng.normal(size=[4, 6, 6, 64]).astype(np.float32) * 10)
  g = tf.constant(rng.normal(size=[4, 6, 6, 64]).astype(np.float32))
  fast = lrn.make_fast_lrn(hparams.LRN_DEPTH_RADIUS, hparams.LRN_BIAS,
                           hparams.LRN_ALPHA, beta)
  y, dx = _value_and_grad(fast, x, g)
  y_ref, dx_ref = _value_and_grad(_reference(beta), x, g)
  assert _rel(y, y_ref) <= REL_TOL
  assert _rel(dx, dx_ref) <= REL_TOL


def test_works_inside_a_tower_function_on_a_logical_device():
  rng = np.random.default_rng(2)
  x = tf.constant(rng.normal(size=[2, 12, 12, 64]).astype(np.float32) * 10)

  @tf.function
  def tower(x):
    with tf.device('/device:CPU:1'):
      with tf.GradientTape() as tape:
        tape.watch(x)
        loss = tf.reduce_sum(lrn.fast_lrn(x) ** 2)
      return loss, tape.gradient(loss, x)

  loss, dx = tower(x)
  with tf.GradientTape() as tape:
    tape.watch(x)
    loss_ref = tf.reduce_sum(lrn.upstream_lrn(x) ** 2)
  dx_ref = tape.gradient(loss_ref, x)
  assert abs(float(loss) - float(loss_ref)) <= REL_TOL * abs(float(loss_ref))
  assert _rel(dx.numpy(), dx_ref.numpy()) <= REL_TOL


def test_for_plan_uses_the_fast_lrn_on_cpu_towers_only():
  cpu = devices.DevicePlan(('/device:CPU:0', '/device:CPU:1'), 'cpu', 2)
  gpu = devices.DevicePlan(('/device:GPU:0',), 'gpu', 1)
  assert lrn.for_plan(cpu) is lrn.fast_lrn
  assert lrn.for_plan(gpu) is lrn.upstream_lrn


def test_modern_trainer_builds_its_model_with_the_plans_lrn(device_plan):
  from cifar10_towers.modern import step as modern_step
  trainer = modern_step.TowerStep(device_plan, decay_steps=10)
  assert trainer.state.model._lrn is lrn.fast_lrn  # pylint: disable=protected-access


def test_legacy_towers_use_the_fast_lrn_on_cpu_plans(device_plan):
  from cifar10_towers.legacy import train as legacy_train
  plan = devices.DevicePlan(device_plan.tower_devices[:2], 'cpu',
                            device_plan.num_cpu_devices)
  with tf.Graph().as_default() as graph:
    batches = [(tf.zeros([2, 24, 24, 3]), tf.zeros([2], tf.int32))] * 2
    legacy_train.build_towers(batches, plan, decay_steps=10)
  types = [op.type for op in graph.get_operations()]
  assert 'LRN' not in types and 'LRNGrad' not in types
  # Per tower: norm1 and norm2, each a forward and a gradient call.
  assert types.count('PartitionedCall') == 2 * 2 * 2


def test_fast_lrn_reads_the_hyperparameters_when_called(monkeypatch):
  x = tf.constant(np.random.default_rng(3).normal(size=[2, 4, 4, 64]).astype(
      np.float32) * 10)
  before = lrn.fast_lrn(x).numpy()
  monkeypatch.setattr(hparams, 'LRN_ALPHA', 0.001)
  after = lrn.fast_lrn(x).numpy()
  assert _rel(after, _reference(hparams.LRN_BETA)(x).numpy()) <= REL_TOL
  assert _rel(after, before) > 1e-3
