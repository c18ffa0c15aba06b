"""modern.train: towers, average_gradients, the update, placement, checkpoints."""

import re

import numpy as np
import pytest
import tensorflow as tf

from cifar10_towers.common import devices
from cifar10_towers.common import model_spec
from cifar10_towers.modern import checkpoints as modern_checkpoints
from cifar10_towers.modern import step as modern_step

# docs/equivalence.md §2: averaged gradients agree to max|a - b| <= 1e-5 * max|b| per variable.
GRAD_REL_TOL = 1e-5


def _plan(num_towers, first=0):
  return devices.DevicePlan(
      tuple('/device:CPU:%d' % i for i in range(first, first + num_towers)), 'cpu', 4)


def _batches(num_towers, batch, seed):
  rng = np.random.default_rng(seed)
  images = rng.standard_normal((num_towers, batch, 24, 24, 3)).astype(np.float32)
  labels = rng.integers(0, 10, (num_towers, batch)).astype(np.int32)
  return images, labels


@pytest.fixture(scope='module')
def initial_values():
  tf.random.set_seed(7)
  trainer = modern_step.TowerStep(_plan(1), decay_steps=100)
  return {name: var.numpy() for name, var in trainer.state.variables().items()}


def _assert_grads_close(got, want):
  for name in model_spec.VARIABLE_NAMES:
    a, b = np.asarray(got[name]), np.asarray(want[name])
    np.testing.assert_allclose(a, b, rtol=0, atol=GRAD_REL_TOL * np.abs(b).max(),
                               err_msg=name)


def test_average_gradients_is_the_mean_over_towers():
  var_a, var_b = tf.Variable([0.0, 0.0]), tf.Variable(0.0)
  tower_grads = [[(tf.constant([1.0, 2.0]), var_a), (tf.constant(3.0), var_b)],
                 [(tf.constant([3.0, -6.0]), var_a), (tf.constant(5.0), var_b)],
                 [(tf.constant([5.0, 1.0]), var_a), (tf.constant(-2.0), var_b)]]
  (grad_a, v_a), (grad_b, v_b) = modern_step.average_gradients(tower_grads)
  assert v_a is var_a and v_b is var_b
  np.testing.assert_allclose(grad_a.numpy(), [3.0, -1.0], rtol=1e-7)
  np.testing.assert_allclose(grad_b.numpy(), 2.0, rtol=1e-7)


@pytest.mark.parametrize('num_towers', [2, 4])
def test_n_towers_equal_one_tower_on_the_concatenation(num_towers, initial_values):
  """docs/equivalence.md §2.4: a true mean, and weight decay counted once."""
  images, labels = _batches(num_towers, 4, seed=num_towers)
  many = modern_step.TowerStep(_plan(num_towers), decay_steps=100)
  many.state.assign_variables(initial_values)
  one = modern_step.TowerStep(_plan(1), decay_steps=100)
  one.state.assign_variables(initial_values)
  grads_n, losses_n = many.compute_gradients((images, labels))
  grads_1, losses_1 = one.compute_gradients(
      (images.reshape(1, -1, 24, 24, 3), labels.reshape(1, -1)))
  assert losses_n.shape == (num_towers,)
  _assert_grads_close(grads_n, grads_1)
  # Equal batch sizes: the mean of the towers' mean losses is the mean loss.
  np.testing.assert_allclose(losses_n.numpy().mean(), losses_1.numpy()[0], rtol=1e-6)


def test_tower_losses_are_each_towers_own(initial_values):
  images, labels = _batches(2, 4, seed=11)
  trainer = modern_step.TowerStep(_plan(2), decay_steps=100)
  trainer.state.assign_variables(initial_values)
  alone = modern_step.TowerStep(_plan(1), decay_steps=100)
  alone.state.assign_variables(initial_values)
  _, losses = trainer.compute_gradients((images, labels))
  for i in range(2):
    _, loss_i = alone.compute_gradients((images[i:i + 1], labels[i:i + 1]))
    np.testing.assert_allclose(losses.numpy()[i], loss_i.numpy()[0], rtol=1e-6)


def test_step_is_sgd_then_moving_average(initial_values):
  """lr from the step before the increment, EMA decay from the step after."""
  trainer = modern_step.TowerStep(_plan(2), decay_steps=1)  # lr 0.1, then 0.01
  trainer.state.assign_variables(initial_values)
  var = {k: v.astype(np.float32) for k, v in initial_values.items()}
  shadow = dict(var)
  for step, lr in ((0, 0.1), (1, 0.01)):
    batches = _batches(2, 4, seed=20 + step)
    grads, _ = trainer.compute_gradients(batches)
    trainer.train_step(batches)
    decay = np.float32(min(0.9999, (1.0 + step + 1) / (10.0 + step + 1)))
    for name in model_spec.VARIABLE_NAMES:
      var[name] = var[name] - np.float32(lr) * grads[name].numpy()
      shadow[name] = shadow[name] - (shadow[name] - var[name]) * (np.float32(1) - decay)
    assert int(trainer.state.global_step.numpy()) == step + 1
    for name in model_spec.VARIABLE_NAMES:
      scale = np.abs(var[name]).max()
      np.testing.assert_allclose(trainer.state.variables()[name].numpy(), var[name],
                                 rtol=0, atol=1e-6 * scale, err_msg=name)
      np.testing.assert_allclose(trainer.state.shadow_variables()[name].numpy(),
                                 shadow[name], rtol=0, atol=1e-6 * scale, err_msg=name)
  # The shadows lag: with decay 2/11 then 3/12 they are not the variables.
  assert not np.allclose(trainer.state.shadow_variables()['softmax_linear/weights'].numpy(),
                         trainer.state.variables()['softmax_linear/weights'].numpy(),
                         rtol=0, atol=1e-7)


def test_ops_of_tower_i_run_on_device_i_and_updates_on_the_cpu():
  plan = _plan(2, first=1)  # towers on CPU:1 and CPU:2, variables on CPU:0
  trainer = modern_step.TowerStep(plan, decay_steps=100)
  # The loop's step, which reads its batches inside it.
  batches = iter(tf.data.Dataset.from_tensors(_batches(2, 2, seed=0)).repeat())
  trainer.next_step(batches)  # the placement runs, not just builds
  graph = trainer.step_graph(batches)
  canonical = lambda d: tf.DeviceSpec.from_string(d).to_string()
  # On CPU towers the LRN and its gradient are calls of common.lrn's XLA
  # functions; the ops inside a call run on the call's device.
  heavy = {'Conv2D', 'Conv2DBackpropFilter', 'Conv2DBackpropInput', 'MatMul',
           'LRN', 'LRNGrad', 'MaxPool', 'MaxPoolGrad',
           'PartitionedCall', 'StatefulPartitionedCall'}
  heavy_per_tower = {0: 0, 1: 0}
  updates = 0
  for op in graph.get_operations():
    match = re.search(r'(?:^|/)tower_(\d+)/', op.name)
    if match:
      tower = int(match.group(1))
      assert canonical(op.device) == canonical(plan.tower_devices[tower]), op.name
      heavy_per_tower[tower] += op.type in heavy
    else:
      assert op.type not in heavy, '%s (%s) is outside the towers' % (op.name, op.type)
    if op.type in ('AssignSubVariableOp', 'AssignAddVariableOp'):
      assert canonical(op.device) == canonical(devices.VARIABLE_DEVICE), op.name
      updates += 1
  assert heavy_per_tower[0] == heavy_per_tower[1] >= 20
  assert updates == 10 + 1 + 10  # SGD, global step, moving averages
  for var in list(trainer.state.variables().values()) + list(
      trainer.state.shadow_variables().values()) + [trainer.state.global_step]:
    assert canonical(var.device).endswith('/device:CPU:0'), var.name


def test_jit_towers_give_the_same_gradients(initial_values):
  images, labels = _batches(2, 4, seed=5)
  plain = modern_step.TowerStep(_plan(2), decay_steps=100)
  plain.state.assign_variables(initial_values)
  jitted = modern_step.TowerStep(_plan(2), decay_steps=100, jit=True)
  jitted.state.assign_variables(initial_values)
  _assert_grads_close(jitted.compute_gradients((images, labels))[0],
                      plain.compute_gradients((images, labels))[0])


def test_wrong_number_of_tower_batches_is_refused():
  trainer = modern_step.TowerStep(_plan(2), decay_steps=100)
  with pytest.raises(ValueError, match=r'with N in \[2\]'):
    trainer.train_step(_batches(3, 2, seed=0))


def test_assign_variables_checks_names_and_shapes(initial_values):
  trainer = modern_step.TowerStep(_plan(1), decay_steps=100)
  partial = dict(initial_values)
  del partial['conv1/biases']
  with pytest.raises(ValueError, match='conv1/biases'):
    trainer.state.assign_variables(partial)
  wrong = dict(initial_values, **{'local4/biases': np.zeros(3, np.float32)})
  with pytest.raises(ValueError, match='local4/biases'):
    trainer.state.assign_variables(wrong)
  shadows = {k: v + 1 for k, v in initial_values.items()}
  trainer.state.assign_variables(initial_values, shadows)
  np.testing.assert_array_equal(trainer.state.variables()['conv2/weights'].numpy(),
                                initial_values['conv2/weights'])
  np.testing.assert_array_equal(trainer.state.shadow_variables()['conv2/weights'].numpy(),
                                shadows['conv2/weights'])


def test_checkpoint_keys_map_to_legacy_names(tmp_path, initial_values):
  trainer = modern_step.TowerStep(_plan(1), decay_steps=100)
  shadows = {k: v * 2 for k, v in initial_values.items()}
  trainer.state.assign_variables(initial_values, shadows)
  trainer.state.global_step.assign(42)
  manager = tf.train.CheckpointManager(modern_checkpoints.checkpoint_object(trainer.state), str(tmp_path),
                                       max_to_keep=5, checkpoint_name='model.ckpt')
  path = manager.save(checkpoint_number=42)  # as train() saves
  assert path == str(tmp_path / 'model.ckpt-42')
  keys = {name for name, _ in tf.train.list_variables(path)}
  legacy = ['global_step'] + list(model_spec.VARIABLE_NAMES) + [
      n + '/ExponentialMovingAverage' for n in model_spec.VARIABLE_NAMES]
  mapped = {modern_checkpoints.checkpoint_key(n) for n in legacy}
  assert keys - mapped == {'_CHECKPOINTABLE_OBJECT_GRAPH',
                           'save_counter/.ATTRIBUTES/VARIABLE_VALUE'}
  assert mapped <= keys
  assert tf.train.load_variable(path, modern_checkpoints.checkpoint_key('global_step')) == 42
  for name in model_spec.VARIABLE_NAMES:
    np.testing.assert_array_equal(
        tf.train.load_variable(path, modern_checkpoints.checkpoint_key(name)), initial_values[name])
    np.testing.assert_array_equal(
        tf.train.load_variable(path, modern_checkpoints.checkpoint_key(name + '/ExponentialMovingAverage')),
        shadows[name])
  # Optimizer slots have keys since --optimizer (common.optimizer); others do not.
  assert (modern_checkpoints.checkpoint_key('conv1/weights/Momentum')
          == 'optimizer/conv1/weights/Momentum/.ATTRIBUTES/VARIABLE_VALUE')
  with pytest.raises(KeyError):
    modern_checkpoints.checkpoint_key('conv1/weights/RMSProp')
