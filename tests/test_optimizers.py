"""Momentum, Adam and gradient clipping: both trainers equal, slots converted bit for bit.

Tolerances are the contract's (crosscheck.py, docs/equivalence.md §2): the
averaged and clipped gradients 1e-5, tower losses 1e-6, each step's update of
every variable, moving average and slot from the same state 1e-5 of its largest
element; Adam's variables 1e-3 of the step's lr per element. The cross-check matrix runs on
tiny batches (2 images per tower, 2 steps) to keep the suite's time: what it
compares is the arithmetic, not learning. Its towers: 1 (nothing to average)
and 3 (the 1/N of a mean not exact in floating point); two of its 3-tower
cells check the mirrored engine too. The sweep's four cells (batch 16, 5 steps,
both engines) run at a random seed each (SWEEP_CELLS below); the injected
differences are tests/test_crosscheck.py's.

The matrix runs through the command line (`crosscheck --optimizer ...`), so
its flags and tables are checked on the way. Its cells are the code paths,
not their product: clipping comes before any update and does not look at the
optimizer, and the N-vs-1 identity's gap is measured on the first step's
gradients, before any update. So 3 towers run momentum and Adam (the
optimizers with slots) under each --clip_where; SGD's update on 3 towers is
tests/test_crosscheck.py's (unclipped) and runs clipped here on 1 tower;
1 tower runs one cell per --clip_where (SGD averaged, Adam per tower).
"""

import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow.compat.v1 as tf1
from click.testing import CliRunner

from cifar10_towers import cli
from cifar10_towers import convert
from cifar10_towers import crosscheck
from cifar10_towers.common import devices
from cifar10_towers.common import model_spec
from cifar10_towers.common import optimizer as optimizer_lib
from cifar10_towers.datasets import digits
from cifar10_towers.runtime import config as config_lib
from cifar10_towers.runtime import training

import faults_support as fs

pytestmark = pytest.mark.slow  # every test: adam_sweep (autouse) starts crosscheck's process

CLIP = 1.0  # well below the initial gradients' global norm: clipping is active


def _plan(device_plan, n):
  return devices.DevicePlan(device_plan.tower_devices[:n], device_plan.kind,
                            device_plan.num_cpu_devices)


def _failed(report):
  return {(check, name) for check, name, _, _ in report.failures()}


def _global_norm(grads):
  return float(np.sqrt(sum(np.sum(np.square(g, dtype=np.float64))
                           for g in grads.values())))


# Cells that hold the mirrored engine to the same contract too, one per
# optimizer with slots and per --clip_where: the replica engines update every
# slot through TrainState (mirrored slots).
MIRRORED = [(3, 'adam', 'averaged'), (3, 'momentum', 'per_tower')]
MATRIX = [(3, name, clip_where) for name in (optimizer_lib.MOMENTUM, optimizer_lib.ADAM)
          for clip_where in optimizer_lib.CLIP_WHERE] + [
              (1, optimizer_lib.SGD, optimizer_lib.AVERAGED),
              (1, optimizer_lib.ADAM, optimizer_lib.PER_TOWER)]



@pytest.mark.parametrize('num_towers,name,clip_where', MATRIX,
                         ids=['-'.join(map(str, cell)) for cell in MATRIX])
def test_crosscheck_matrix(monkeypatch, num_towers, name, clip_where):
  """Each cell through the command line: its optimizer flags reach both trainers."""
  spec = optimizer_lib.OptimizerSpec(name=name, clip_norm=CLIP, clip_where=clip_where)
  mirrored = (num_towers, name, clip_where) in MIRRORED
  engines = ('towers', 'mirrored') if mirrored else ('towers',)
  result, (reports, *_) = fs.crosscheck_cli(monkeypatch, [
      '--num_gpus', num_towers, '--batch_size', 2, '--steps', 2, '--seed', num_towers,
      '--optimizer', name, '--clip_norm', CLIP, '--clip_where', clip_where,
      '--strategy', 'mirrored' if mirrored else 'towers'])
  assert result.exit_code == 0, result.output
  assert result.output.count('PASS: all') == len(engines), result.output
  assert set(reports) == set(engines)
  for engine in engines:
    assert reports[engine].passed, (engine, crosscheck.format_report(reports[engine]))
  # With several engines, the same legacy result is the reference of each comparison.
  assert all(reports[engine].legacy is reports['towers'].legacy for engine in engines)
  report = reports['towers']
  slots = [row for row in report.rows if row.check == '3 step update: slot']
  assert [row.name for row in slots] == list(spec.slot_names())
  for slot_name in spec.slot_names():
    value = report.legacy.final[slot_name]
    if '/' in slot_name:  # a real comparison: the slots moved from zero
      assert np.any(value != 0), slot_name
  if clip_where == optimizer_lib.AVERAGED:
    # Clipping is active, and the identity held to the contract.
    assert _global_norm(report.legacy.applied) == pytest.approx(CLIP, rel=1e-5)
    assert any(row[0] == '1 clipped averaged gradient' for row in report.rows)
    assert report.per_tower_identity_gap() is None
  else:
    gap = report.per_tower_identity_gap()
    assert gap is not None
    assert 'not held' in result.output  # the identity's rows: reported, not held
    if num_towers == 1:
      assert gap <= crosscheck.GRAD_RTOL  # one tower: nothing to differ
    else:
      assert gap > 1e-2  # the pitfall, measured
      assert 'NOT 1 tower on the concatenation' in crosscheck.format_report(report)
      assert 'NOT 1 tower on the concatenation' in result.output


def test_adam_variables_are_held_to_the_steps_lr_per_element():
  """Adam's variables: each element within 1e-3 of the step's lr (one rounding-sized
  gradient steers part of an lr step); its slots and every SGD row: 1e-5 of the largest."""
  init = crosscheck.initial_values(0)

  def rows(name, key, offset, global_step=2):
    spec = optimizer_lib.OptimizerSpec(name=name)
    before = dict(crosscheck.initial_state(init, spec), global_step=np.int64(global_step))
    after = {n: np.asarray(v, np.float64) + (0.01 if n != 'global_step' else 1)
             for n, v in before.items()}
    other = dict(after)
    other[key] = after[key].copy()
    other[key].flat[0] += offset
    grads = dict.fromkeys(model_spec.VARIABLE_NAMES, 0.0)  # equal in both: no allowance
    return {row.name: row for row in crosscheck._update_rows(  # pylint: disable=protected-access
        before, crosscheck.Step(grads, grads, None, other),
        crosscheck.Step(grads, grads, None, after), spec, decay_steps=2)}

  lr = 0.1 * 0.1  # global step 2, decay_steps 2: the staircase's second stair
  assert rows('adam', 'conv2/weights', 0.5e-3 * lr)['conv2/weights'].measured <= 1e-3
  assert rows('adam', 'conv2/weights', 2e-3 * lr)['conv2/weights'].measured > 1e-3
  # The same difference where the gradients differ by 2e-3 epsilon there: it may move
  # the step 2e-3 lr (an Adam step moves at most lr / epsilon per unit of gradient).
  spec = optimizer_lib.OptimizerSpec(name='adam')
  before = dict(crosscheck.initial_state(init, spec), global_step=np.int64(2))
  after = dict(before, **{'conv2/weights': before['conv2/weights'] + 0.01})
  other = dict(after, **{'conv2/weights': after['conv2/weights'] + 2e-3 * lr})
  grads = dict.fromkeys(model_spec.VARIABLE_NAMES, 0.0)
  moved = dict(grads, **{'conv2/weights': 2.1e-3 * spec.adam_epsilon})
  row = {r.name: r for r in crosscheck._update_rows(  # pylint: disable=protected-access
      before, crosscheck.Step(moved, moved, None, other), crosscheck.Step(grads, grads, None, after),
      spec, decay_steps=2)}['conv2/weights']
  assert row.measured <= 1e-3
  # An update of 0.01 everywhere: 1e-5 of it is 1e-7, beyond float32's spacing of ~0.1.
  for name, key in (('adam', 'conv2/weights/Adam_1'), ('sgd', 'conv2/weights'),
                    ('momentum', 'conv2/weights/Momentum')):
    assert rows(name, key, 3e-8)[key].measured <= 1e-5, key
    assert rows(name, key, 1e-6)[key].measured > 1e-5, key


def test_optimizer_flags_for_another_optimizer_are_usage_errors():
  result = CliRunner().invoke(cli.cli, ['legacy', '--adam_beta1', '0.8',
                                        '--optimizer', 'momentum'])
  assert result.exit_code == 2
  assert '--adam_beta1 is for --optimizer adam' in result.output


# --- checkpoints: slots converted bit for bit, resume refused across optimizers --

ADAM = optimizer_lib.OptimizerSpec(name='adam', learning_rate=0.001, clip_norm=CLIP)
DECAY_STEPS = 1000


@pytest.fixture(scope='module')
def adam_legacy_dir(tmp_path_factory, synth_data_dir, device_plan):
  """A legacy train_dir after 4 Adam steps with clipping, on 2 towers."""
  from cifar10_towers.legacy import train as legacy_train
  train_dir = str(tmp_path_factory.mktemp('adam_legacy'))
  config = config_lib.TrainConfig(data_dir=synth_data_dir, train_dir=train_dir,
                                  num_gpus=2, batch_size=8, max_steps=4,
                                  save_every=100, optimizer=ADAM)
  legacy_train.train(config, _plan(device_plan, 2), num_threads=2)
  return train_dir


def _tensors(path):
  return {name: tf.train.load_variable(path, name)
          for name, _ in tf.train.list_variables(path)}


def _legacy_losses(path, plan, images, labels, steps):
  """Tower losses of `steps` legacy steps on fixed batches, from checkpoint `path`."""
  from cifar10_towers.legacy import train as legacy_train
  with tf.Graph().as_default():
    batches = [(tf.constant(images[i]), tf.constant(labels[i]))
               for i in range(images.shape[0])]
    towers = legacy_train.build_towers(batches, plan, DECAY_STEPS, optimizer=ADAM)
    saver = tf1.train.Saver(tf1.global_variables())
    with tf1.Session(config=legacy_train.session_config(plan)) as sess:
      saver.restore(sess, path)
      return np.array([sess.run([towers.train_op, towers.tower_losses])[1]
                       for _ in range(steps)])


def _modern_losses(path, plan, images, labels, steps):
  """The same with modern's towers, from a modern checkpoint."""
  from cifar10_towers.modern import checkpoints as modern_checkpoints
  from cifar10_towers.modern import step as modern_step
  trainer = modern_step.TowerStep(plan, DECAY_STEPS, optimizer=ADAM)
  modern_checkpoints.checkpoint_object(trainer.state).restore(
      path).assert_existing_objects_matched()
  return np.array([trainer.train_step((images, labels)).numpy()
                   for _ in range(steps)])


def test_adam_round_trip_is_bit_for_bit_and_trains_on_the_same(
    adam_legacy_dir, tmp_path, device_plan):
  modern_dir, back_dir = str(tmp_path / 'modern'), str(tmp_path / 'back')
  _, _, step, modern_path = convert.convert(adam_legacy_dir, modern_dir)
  assert step == 4
  _, _, _, back_path = convert.convert(modern_dir, back_dir)
  original_path = tf.train.latest_checkpoint(adam_legacy_dir)
  original, back = _tensors(original_path), _tensors(back_path)
  # 10 weights, 10 averages, global_step, 20 Adam slots, 2 beta powers.
  assert len(original) == 43
  assert set(back) == set(original)
  for name, value in original.items():
    assert back[name].dtype == value.dtype, name
    assert np.array_equal(back[name], value), name
  assert original['beta1_power'] == np.float32(0.9) ** 5  # step 4, then one more
  modern = _tensors(modern_path)
  from cifar10_towers.modern import checkpoints as modern_checkpoints
  for name in ADAM.slot_names():
    assert np.array_equal(modern[modern_checkpoints.checkpoint_key(name)],
                          original[name]), name

  # Training on from the converted checkpoint continues the unconverted one's
  # loss curve (modern from the converted, legacy from the original).
  plan = _plan(device_plan, 2)
  images, labels = crosscheck.draw_batches(2, 8, seed=11)
  legacy_curve = _legacy_losses(original_path, plan, images, labels, 5)
  modern_curve = _modern_losses(modern_path, plan, images, labels, 5)
  assert legacy_curve.shape == (5, 2)
  np.testing.assert_allclose(modern_curve, legacy_curve, rtol=1e-4, atol=0)
  assert not np.allclose(legacy_curve[0], legacy_curve[-1])  # it trains


def test_resume_refuses_another_optimizer(adam_legacy_dir, synth_data_dir,
                                          tmp_path, device_plan):
  from cifar10_towers.legacy import train as legacy_train
  from cifar10_towers.modern import train as modern_train
  plan = _plan(device_plan, 1)

  def config(train_dir, optimizer):
    return config_lib.TrainConfig(data_dir=synth_data_dir, train_dir=train_dir,
                                  num_gpus=1, batch_size=4, max_steps=10,
                                  optimizer=optimizer)

  sgd = optimizer_lib.OptimizerSpec()
  # An Adam checkpoint resumed with SGD: legacy, and modern after conversion.
  with pytest.raises(training.TrainingError,
                     match='trained with --optimizer adam; this run has '
                           '--optimizer sgd, which would drop'):
    legacy_train.train(config(adam_legacy_dir, sgd), plan, num_threads=1)
  modern_dir = str(tmp_path / 'modern')
  convert.convert(adam_legacy_dir, modern_dir)
  with pytest.raises(training.TrainingError, match='Resume it with --optimizer adam'):
    modern_train.train(config(modern_dir, sgd), plan)
  # The reverse: an SGD checkpoint resumed with Adam or momentum.
  init = crosscheck.initial_values(0)
  sgd_modern, sgd_legacy = str(tmp_path / 'sgd_modern'), str(tmp_path / 'sgd_legacy')
  os.makedirs(sgd_modern)
  os.makedirs(sgd_legacy)
  state = {**init, **{model_spec.average_name(name): value for name, value in init.items()},
           'global_step': 3}  # as convert.state_of reads an SGD checkpoint
  convert.write_modern(sgd_modern, state, optimizer_lib.SGD)
  convert.write_legacy(sgd_legacy, state, optimizer_lib.SGD)
  with pytest.raises(training.TrainingError, match='which would zero-fill'):
    modern_train.train(config(sgd_modern, ADAM), plan)
  with pytest.raises(training.TrainingError, match='--optimizer sgd; this run has '
                                                   '--optimizer momentum'):
    legacy_train.train(config(sgd_legacy, optimizer_lib.OptimizerSpec(name='momentum')),
                       plan, num_threads=1)
  # Nothing was written into the refused train_dirs.
  for train_dir in (sgd_legacy, sgd_modern):
    assert not [f for f in os.listdir(train_dir)
                if f.startswith('model.ckpt-') and not f.startswith('model.ckpt-3.')]
    assert not [f for f in os.listdir(train_dir) if 'tfevents' in f]


def test_cli_resume_refusal_is_one_line(adam_legacy_dir, synth_data_dir):
  result = CliRunner().invoke(cli.cli, [
      'legacy', '--data_dir', synth_data_dir, '--train_dir', adam_legacy_dir,
      '--batch_size', '4', '--max_steps', '10'])
  assert result.exit_code == 1, result.output
  assert 'Error: ' in result.output
  assert '--optimizer adam' in result.output
  assert 'Traceback' not in result.output


# The sweep's cells (docs/equivalence.md §2): each configuration on the generated set
# of `data synth` (its flat regions make max-pool ties common) and on `data digits`'s,
# each engine of each cell at one seed drawn at random per run, printed, and replayed
# with CIFAR10_TOWERS_CROSSCHECK_SEED=<the printed seed>: cell i checks the towers
# engine at seed + 2i and the mirrored engine at seed + 2i + 1, batch 16, 5 steps. A
# configuration's four draws share one build of the trainers (crosscheck.run's draws).
SWEEP_CONFIGS = [(3, dict(name='momentum', clip_norm=CLIP, clip_where='averaged')),
                 (3, dict(name='sgd')),
                 (2, dict(name='adam', learning_rate=0.001, clip_norm=CLIP,
                          clip_where='per_tower')),
                 (2, dict(name='adam', learning_rate=0.1, clip_norm=CLIP, clip_where='per_tower'))]
SWEEP_DATA = ('synth', 'digits')
SEED = int(os.environ.get('CIFAR10_TOWERS_CROSSCHECK_SEED') or np.random.SeedSequence().entropy
           % 10**6)


def _draws(config, data_dirs):
  """crosscheck.run's draws of configuration `config`'s cells (one per data set)."""
  cells = [(config + len(SWEEP_CONFIGS) * d, data) for d, data in enumerate(SWEEP_DATA)]
  return [(SEED + 2 * cell + m, data_dirs[data], [engine]) for cell, data in cells
          for m, engine in enumerate(('towers', 'mirrored'))]


@pytest.fixture(scope='module', autouse=True)
def sweep_cells(tmp_path_factory, synth_data_dir):
  """The cells' cross-checks, started as the module begins: they run in a process of
  their own (faults_support.crosscheck_in_background) beside the module's other tests."""
  print(f'\nCross-check cells at seeds {SEED} + 2i (towers), + 2i + 1 (mirrored) '
        f'(replay: CIFAR10_TOWERS_CROSSCHECK_SEED={SEED})')
  digits_dir = str(tmp_path_factory.mktemp('digits'))
  digits.convert_digits(digits_dir, seed=0)
  data_dirs = {'synth': synth_data_dir, 'digits': digits_dir}
  runs = [dict(num_towers=num_towers, optimizer=optimizer, batch_size=16, steps=5,
               engines=['towers', 'mirrored'], draws=_draws(config, data_dirs))
          for config, (num_towers, optimizer) in enumerate(SWEEP_CONFIGS)]
  wait = fs.crosscheck_in_background(runs, str(tmp_path_factory.mktemp('sweep_cells')))
  yield wait
  wait.proc.kill()  # a no-op once it ended (when a test of the cells ran)


@pytest.mark.parametrize('config', range(len(SWEEP_CONFIGS)))
def test_the_contract_holds_at_a_random_seed(sweep_cells, config):
  """crosscheck.run: legacy against the towers and the mirrored engine, each at its seed,
  on both data sets (a figure's row names the seed it was worst at)."""
  code, output, (reports, *_) = sweep_cells()[config]
  assert code == 0, (f'seeds {[seed for seed, *_ in _draws(config, dict.fromkeys(SWEEP_DATA))]} '
                     f'(CIFAR10_TOWERS_CROSSCHECK_SEED={SEED})', output)
  assert set(reports) == {'towers', 'mirrored'}
  for engine, report in reports.items():
    assert report.passed, (engine, crosscheck.format_report(report))
