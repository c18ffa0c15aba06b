"""The cross-check: legacy and modern compute the same averaged gradients (docs/equivalence.md §2).

Both trainers are built from the same initial variables and fed the same N
per-tower batches, already preprocessed. Compared:

1. the averaged gradients at the initial variables, per variable:
   max|a - b| / max|b| <= GRAD_RTOL;
2. the per-tower total losses, relative, <= LOSS_RTOL;
3. the variables and their moving averages after K training steps on those
   batches (learning-rate schedule and EMA included), relative, <= FINAL_RTOL;
4. the identity: N towers on b1..bN give the averaged gradient of 1 tower on
   their concatenation, <= GRAD_RTOL, in each implementation. This is what
   proves the averaging is a true mean and weight decay is counted once.

`run()` returns a `Report`; `write_evidence()` writes the file of docs/equivalence.md §2 that
anyone can re-check with their own code.
"""

import dataclasses
import functools
import os

import numpy as np

from common import cifar10_format as fmt
from common import config as config_lib
from common import hparams
from common import model_spec

GRAD_RTOL = 1e-5  # contract 1 and 4: averaged gradients, relative to max|g|
LOSS_RTOL = 1e-6  # contract 2: per-tower total losses
FINAL_RTOL = 1e-4  # contract 3: variables and moving averages after K steps


def rel_diff(a, b):
  """max|a - b| / max|b| (0 when both are all zero)."""
  a = np.asarray(a, np.float64)
  b = np.asarray(b, np.float64)
  scale = np.max(np.abs(b)) if b.size else 0.0
  diff = np.max(np.abs(a - b)) if a.size else 0.0
  if scale == 0.0:
    return 0.0 if diff == 0.0 else np.inf
  return float(diff / scale)


def initial_values(seed):
  """Initial variables drawn as the initializers of docs/equivalence.md §1 would, from a seed.

  Returns:
    dict variable name -> float32 array: truncated normal weights (resampled
    beyond two standard deviations, as `truncated_normal` does) and constant
    biases.
  """
  rng = np.random.default_rng(seed)
  values = {}
  for layer in model_spec.LAYERS:
    w = rng.standard_normal(layer.weight_shape)
    bad = np.abs(w) > 2.0
    while bad.any():
      w[bad] = rng.standard_normal(int(bad.sum()))
      bad = np.abs(w) > 2.0
    values[layer.name + '/weights'] = (w * layer.stddev).astype(np.float32)
    values[layer.name + '/biases'] = np.full(layer.weight_shape[-1:],
                                             layer.bias_init, np.float32)
  return values


def draw_batches(num_towers, batch_size, seed, data_dir=None):
  """N preprocessed tower batches, from a data dir or generated.

  Args:
    num_towers: N.
    batch_size: B, images per tower.
    seed: int; the same seed gives the same batches.
    data_dir: str or None; None uses generated data.

  Returns:
    images float32 [N, B, 24, 24, 3] (training distortions applied),
    labels int32 [N, B].
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  from common import preprocess  # pylint: disable=g-import-not-at-top
  n = num_towers * batch_size
  rng = np.random.default_rng(seed)
  if data_dir is None:
    from common import synth  # pylint: disable=g-import-not-at-top
    labels = rng.permutation(np.arange(n) % hparams.NUM_CLASSES).astype(np.int32)
    raw = synth.make_images(rng, labels)
  else:
    images, labels = [], []
    for path in fmt.train_files(data_dir):
      file_images, file_labels = fmt.read_records(path)
      images.append(file_images)
      labels.append(file_labels)
      if sum(len(x) for x in labels) >= n:
        break
    raw, labels = np.concatenate(images), np.concatenate(labels)
    if len(labels) < n:
      raise fmt.DataError('%s holds %d training records; the cross-check needs '
                          '%d (num_gpus x batch_size).' % (data_dir, len(labels), n))
    pick = rng.choice(len(labels), n, replace=False)
    raw, labels = raw[pick], labels[pick].astype(np.int32)
  tf.random.set_seed(seed)
  distorted = np.stack([preprocess.distort_image(tf.constant(image)).numpy()
                        for image in raw])
  return (distorted.reshape(num_towers, batch_size, hparams.IMAGE_SIZE,
                            hparams.IMAGE_SIZE, 3),
          labels.reshape(num_towers, batch_size))


@dataclasses.dataclass
class Result:
  """What one implementation computed on the cross-check's inputs."""
  grads: dict  # variable name -> averaged gradient at the initial variables
  tower_losses: np.ndarray  # [N] total loss of each tower
  final: dict  # variable name -> value after K steps
  final_ema: dict  # variable name -> moving average after K steps
  single_tower_grads: dict  # 1 tower on the concatenated batches


@dataclasses.dataclass
class Report:
  """The comparison, with each figure and its tolerance."""
  rows: list  # (check, variable, measured, tolerance)
  legacy: Result
  modern: Result

  @property
  def passed(self):
    return all(measured <= tol for _, _, measured, tol in self.rows)

  def failures(self):
    return [row for row in self.rows if not row[2] <= row[3]]


def compare(legacy, modern, grad_rtol=GRAD_RTOL, loss_rtol=LOSS_RTOL,
            final_rtol=FINAL_RTOL):
  """Builds the Report rows of docs/equivalence.md §2 from two Results."""
  rows = []
  for name in model_spec.VARIABLE_NAMES:
    rows.append(('1 averaged gradient', name,
                 rel_diff(legacy.grads[name], modern.grads[name]), grad_rtol))
  for i, (a, b) in enumerate(zip(legacy.tower_losses, modern.tower_losses)):
    rows.append(('2 tower loss', 'tower_%d' % i, rel_diff(a, b), loss_rtol))
  for name in model_spec.VARIABLE_NAMES:
    rows.append(('3 variable after K steps', name,
                 rel_diff(legacy.final[name], modern.final[name]), final_rtol))
  for name in model_spec.VARIABLE_NAMES:
    rows.append(('3 moving average after K steps', name,
                 rel_diff(legacy.final_ema[name], modern.final_ema[name]), final_rtol))
  for impl, result in (('legacy', legacy), ('modern', modern)):
    for name in model_spec.VARIABLE_NAMES:
      rows.append(('4 identity (%s): N towers vs 1 on concat' % impl, name,
                   rel_diff(result.grads[name], result.single_tower_grads[name]),
                   grad_rtol))
  return Report(rows, legacy, modern)


def format_report(report):
  """The per-variable table, one row per figure, then the verdict."""
  lines = ['%-44s %-24s %11s %9s  %s' % ('check', 'variable / tower', 'rel diff',
                                        'tolerance', '')]
  for check, name, measured, tol in report.rows:
    lines.append('%-44s %-24s %11.3e %9.0e  %s'
                 % (check, name, measured, tol, 'ok' if measured <= tol else 'FAIL'))
  failures = report.failures()
  if failures:
    lines.append('FAIL: %d of %d figures outside the contract.'
                 % (len(failures), len(report.rows)))
  else:
    lines.append('PASS: all %d figures within the contract (docs/equivalence.md §2).'
                 % len(report.rows))
  return '\n'.join(lines)


def write_evidence(path_dir, images, labels, init, report):
  """Writes `<dir>/crosscheck.npz` in the format of docs/equivalence.md §2."""
  os.makedirs(path_dir, exist_ok=True)
  arrays = {'images': images.astype(np.float32), 'labels': labels.astype(np.int32)}
  for name in model_spec.VARIABLE_NAMES:
    arrays['init/' + name] = init[name]
    for impl, result in (('legacy', report.legacy), ('modern', report.modern)):
      arrays['%s/grad/%s' % (impl, name)] = np.asarray(result.grads[name], np.float32)
      arrays['%s/final/%s' % (impl, name)] = np.asarray(result.final[name], np.float32)
  for impl, result in (('legacy', report.legacy), ('modern', report.modern)):
    arrays[impl + '/tower_loss'] = np.asarray(result.tower_losses, np.float32)
  path = os.path.join(path_dir, 'crosscheck.npz')
  tmp = path + '.tmp.npz'
  np.savez(tmp, **arrays)
  os.replace(tmp, path)
  return path


def _single_tower(plan):
  """The plan's first device alone, for the identity check."""
  from common import devices  # pylint: disable=g-import-not-at-top
  return devices.DevicePlan(plan.tower_devices[:1], plan.kind, plan.num_cpu_devices)


def _legacy_run(plan, init, images, labels, steps, decay_steps):
  """Legacy's averaged gradients, tower losses, and state after `steps` steps.

  The graph is legacy's own `build_towers`, fed constants instead of the
  prefetch queue; the variables and their moving averages start at `init`.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tensorflow.compat.v1 as tf1  # pylint: disable=g-import-not-at-top
  from legacy import train as legacy_train  # pylint: disable=g-import-not-at-top
  num_towers = images.shape[0]
  with tf.Graph().as_default():
    batches = [(tf.constant(images[i]), tf.constant(labels[i]))
               for i in range(num_towers)]
    towers = legacy_train.build_towers(batches, plan, decay_steps)
    variables = {v.op.name: v for v in tf1.trainable_variables()}
    shadows = {name: towers.ema.average(var) for name, var in variables.items()}
    grads = {var.op.name: grad for grad, var in towers.averaged_grads}
    with tf1.Session(config=legacy_train.session_config(plan)) as sess:
      sess.run(tf1.global_variables_initializer())
      for name in model_spec.VARIABLE_NAMES:
        variables[name].load(init[name], sess)
        shadows[name].load(init[name], sess)
      grad_values, losses = sess.run([grads, towers.tower_losses])
      for _ in range(steps):
        sess.run(towers.train_op)
      final, final_ema = sess.run([variables, shadows])
  return grad_values, np.asarray(losses), final, final_ema


def _modern_run(build, plan, init, images, labels, steps, decay_steps):
  """The same with a modern engine's step (the tf.function towers, or a strategy)."""
  trainer = build(plan, decay_steps)
  trainer.state.assign_variables(init)
  grads, losses = trainer.compute_gradients((images, labels))
  grads = {name: g.numpy() for name, g in grads.items()}
  losses = np.asarray(losses)
  for _ in range(steps):
    trainer.train_step((images, labels))
  final = {name: v.numpy() for name, v in trainer.state.variables().items()}
  final_ema = {name: v.numpy() for name, v in trainer.state.shadow_variables().items()}
  return grads, losses, final, final_ema


def _result(run, plan, init, images, labels, steps, decay_steps):
  grads, losses, final, final_ema = run(plan, init, images, labels, steps,
                                        decay_steps)
  n, b = labels.shape
  single_grads = run(_single_tower(plan), init,
                     images.reshape((1, n * b) + images.shape[2:]),
                     labels.reshape(1, n * b), 0, decay_steps)[0]
  return Result(grads, losses, final, final_ema, single_grads)


def modern_engines():
  """Name -> callable(plan, decay_steps) building that modern engine's step.

  'towers' is modern's own tf.function towers; 'mirrored' runs the same step
  under tf.distribute.MirroredStrategy (see modern.engines; 'multiworker'
  needs several processes and has its own test).
  """
  from modern import engines  # pylint: disable=g-import-not-at-top

  def builder(name):
    return lambda plan, decay_steps: engines.make(config_lib.TrainConfig(
        num_gpus=plan.num_towers, strategy=name), plan).build(decay_steps)
  return {name: builder(name) for name in ('towers', 'mirrored')}


def run(plan, batch_size=16, steps=5, seed=0, data_dir=None, decay_steps=2,
        engines=('towers',), tolerances=None, progress=None):
  """Runs the whole cross-check.

  Args:
    plan: common.devices.DevicePlan; N = plan.num_towers towers.
    batch_size: images per tower.
    steps: K, training steps before comparing variables and moving averages.
    seed: seeds the batches and the initial variables.
    data_dir: draw the batches from this data dir; None = generated data.
    decay_steps: learning-rate decay interval; small by default so that K
      steps cross the staircase.
    engines: the modern engines to compare with legacy (`modern_engines()`);
      with several, each is held to the same contract against legacy, which
      makes the comparison N-way.
    tolerances: optional dict overriding GRAD_RTOL / LOSS_RTOL / FINAL_RTOL
      (keys 'grad_rtol', 'loss_rtol', 'final_rtol').
    progress: optional callable(str) for progress lines.

  Returns:
    (dict engine -> Report, images [N,B,24,24,3], labels [N,B], initial
     variables dict).
  """
  progress = progress or (lambda _: None)
  images, labels = draw_batches(plan.num_towers, batch_size, seed, data_dir)
  init = initial_values(seed)
  progress('legacy: %d tower(s) x %d images, %d steps...'
           % (plan.num_towers, batch_size, steps))
  legacy = _result(_legacy_run, plan, init, images, labels, steps, decay_steps)
  classes = modern_engines()
  reports = {}
  for engine in engines:
    progress('modern (%s): %d tower(s) x %d images, %d steps...'
             % (engine, plan.num_towers, batch_size, steps))
    modern = _result(functools.partial(_modern_run, classes[engine]), plan, init,
                     images, labels, steps, decay_steps)
    reports[engine] = compare(legacy, modern, **(tolerances or {}))
  return reports, images, labels, init
