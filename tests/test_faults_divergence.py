"""Divergence: a loss that is NaN, inf or above a bound stops training, naming the step and tower.

Upstream only asserted (`assert not np.isnan(loss_value)`), with a traceback
and no word on what was kept. Here the run exits 1 with one line, the step
that diverged is not saved, and the last checkpoint before it stays the
latest, its files untouched. A finite loss counts too once it is above
`training.DIVERGED_LOSS`, 100 times a fresh model's loss: a run can sit at a
finite loss of 1e34 for thousands of steps without ever reaching inf.
"""

import math
import os
import re

import numpy as np
import pytest
import tensorflow as tf

import faults_support as fs
from cifar10_towers.common import devices
from cifar10_towers.runtime import checkpoints
from cifar10_towers.runtime import training

# How train_dir's model.ckpt-2 is blown up: (variable, factor, what follows).
BLOW_UPS = {
    # Logits 1e15 times too large: a huge loss, then inf or nan.
    'explodes': ('softmax_linear/weights', 1e15),
    # Weight decay 400 times its size (~880): finite, and stays so (each step
    # shrinks the weights by only lr * 0.004); before the bound, runs went on.
    'finite': ('local3/weights', 20.0),
}
BOUND = (" (above 468, 100 times a fresh model's loss of 4.68)")


@pytest.mark.parametrize('losses, message', [
    ([1.0, float('nan'), 2.0], 'loss = nan at step 7 in tower 1;'),
    ([float('inf')], 'loss = inf at step 7 in tower 0;'),
    ([1.0, 2.0, 3.0, -float('inf')], 'loss = -inf at step 7 in tower 3;'),
    ([4.7, 1e34], 'loss = 1e+34 at step 7 in tower 1' + BOUND + ';'),
    ([468.5], 'loss = 468.5 at step 7 in tower 0' + BOUND + ';'),
    ([3.0, 880.25, float('nan')], 'loss = 880.2 at step 7 in tower 1' + BOUND + ';'),
])
def test_check_divergence_names_the_step_and_the_tower(losses, message):
  with pytest.raises(training.TrainingError, match=re.escape(message)):
    training.check_divergence(7, np.array(losses, np.float32))


@pytest.mark.parametrize('losses', [
    [1.0, 2.0], [training.INITIAL_LOSS], [12.8, 0.0], [training.DIVERGED_LOSS]])
def test_check_divergence_passes_what_training_sees(losses):
  training.check_divergence(7, np.array(losses, np.float64))


def test_the_bound_is_100_times_a_fresh_models_loss(synth_data_dir, device_plan):
  """INITIAL_LOSS = ln(10) + the expected weight decay, as a fresh model measures it."""
  from cifar10_towers.common import model_spec
  from cifar10_towers.modern import inputs
  from cifar10_towers.modern import step as modern_step
  # The weight decay of the model's own table, over truncated-normal weights
  # (tf.random.truncated_normal cuts at 2 stddevs: 0.7737 of the variance).
  decay = sum(layer.wd * 0.5 * 0.7737 * layer.stddev ** 2
              * np.prod(layer.weight_shape) for layer in model_spec.LAYERS
              if layer.wd)
  assert training.INITIAL_LOSS == pytest.approx(math.log(10) + decay, rel=1e-4)
  assert training.INITIAL_LOSS == pytest.approx(4.676, abs=0.005)
  assert training.DIVERGED_LOSS == 100 * training.INITIAL_LOSS
  # What a fresh model's towers measure on 4 batches of 64, before any step:
  # each tower's loss (modern_step.tower_loss, the towers' own), without the
  # gradients, which this needs not.
  tf.random.set_seed(1)
  trainer = modern_step.TowerStep(devices.plan_devices(4),
                          decay_steps=100)
  images, labels = next(iter(inputs.distorted_inputs(synth_data_dir, 64, 4, seed=1)))
  tower_losses = [modern_step.tower_loss(trainer.state.model, images[i], labels[i])
                  for i in range(4)]
  np.testing.assert_allclose(np.array(tower_losses), training.INITIAL_LOSS,
                             atol=0.1)


def _blow_up(impl, src, train_dir, how):
  """train_dir := model.ckpt-2 of `src` with one variable scaled (BLOW_UPS[how])."""
  variable, scale = BLOW_UPS[how]
  os.makedirs(train_dir)
  path = os.path.join(src, 'model.ckpt-2')
  if impl == 'legacy':
    reader = tf.train.load_checkpoint(path)
    with tf.Graph().as_default():
      variables = {}
      for name in reader.get_variable_to_shape_map():
        value = reader.get_tensor(name)
        if name == variable:
          value = value * scale
        variables[name] = tf.compat.v1.Variable(value, name=name.replace('/', '_'))
      saver = tf.compat.v1.train.Saver(variables, save_relative_paths=True)
      with tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        saver.save(sess, os.path.join(train_dir, 'model.ckpt'), global_step=2)
  else:
    from cifar10_towers.modern import checkpoints as modern_checkpoints
    from cifar10_towers.modern import step as modern_step
    trainer = modern_step.TowerStep(devices.plan_devices(1),
                            decay_steps=100)
    checkpoint = modern_checkpoints.checkpoint_object(trainer.state)
    checkpoint.restore(path).assert_existing_objects_matched()
    weights = trainer.state.variables()[variable]
    weights.assign(weights * scale)
    tf.train.CheckpointManager(checkpoint, train_dir, 5,
                               checkpoint_name='model.ckpt').save(2)


@pytest.fixture(scope='module')
def diverged_runs(synth_data_dir, tmp_path_factory):
  """Both trainers resumed from each blown-up checkpoint on 2 towers, in this process."""
  runs = {}
  for impl in fs.TRAINERS:
    for how in BLOW_UPS:
      train_dir = str(tmp_path_factory.mktemp('diverge_%s_%s' % (impl, how))
                      / 'train')
      _blow_up(impl, fs.trained_dir(impl, synth_data_dir), train_dir, how)
      before = fs.snapshot(train_dir)
      code, out, err, exception = fs.invoke_cli(
          [impl, '--data_dir', synth_data_dir, '--train_dir', train_dir,
           '--num_gpus', 2, '--max_steps', 40, '--save_every', 1, '--seed', 0]
          + list(fs.FAST_FLAGS))
      assert exception is None, exception  # a user would see a traceback
      runs[impl, how] = (train_dir, before, code, out, err)
  return runs


@pytest.mark.slow
@pytest.mark.parametrize('how', BLOW_UPS)
@pytest.mark.parametrize('impl', fs.TRAINERS)
def test_divergence_exits_1_naming_step_and_tower_and_keeps_the_last_checkpoint(
    diverged_runs, impl, how):
  train_dir, before, code, out, err = diverged_runs[impl, how]
  assert 'Traceback' not in out + err
  errors = [line for line in err.splitlines() if line.startswith('Error: ')]
  assert len(errors) == 1, err[-2000:]
  match = re.fullmatch(
      r'Error: Model diverged with loss = (\S+) at step (\d+) in tower ([01])'
      r'(%s)?; the last good checkpoint is kept\. Lower the learning rate or '
      r'check the input data\.' % re.escape(BOUND), errors[0])
  assert match, errors[0]
  loss = float(match.group(1))
  # Above the bound (said so), or not finite.
  assert (math.isfinite(loss) and loss > training.DIVERGED_LOSS) == bool(
      match.group(4)), errors[0]
  if how == 'finite':
    # Caught at once, at its first step, at a finite loss near 880.
    assert 800 < loss < 1000, errors[0]
    assert int(match.group(2)) == 3
  assert code == 1
  step = int(match.group(2))
  assert step > 2
  # Every step before it was logged with a finite loss and saved (save_every 1);
  # the diverged step was not.
  logged = {int(s): float(l) for s, l in
            re.findall(r': step (\d+), loss = (\S+) \(', out)}
  assert sorted(logged) == list(range(3, step))
  assert all(math.isfinite(l) for l in logged.values())
  last_good = os.path.join(train_dir, 'model.ckpt-%d' % (step - 1))
  assert checkpoints.resume_point(train_dir) == last_good
  assert not os.path.exists(os.path.join(train_dir, 'model.ckpt-%d.index' % step))
  # The checkpoint that was there is untouched (the state file moved on to
  # the checkpoints this run wrote).
  state = os.path.join(train_dir, checkpoints.STATE_FILE)
  del before[state]
  assert fs.changed(before, fs.snapshot(train_dir)) == []
