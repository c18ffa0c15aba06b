"""The cross-check: legacy and modern compute the same averaged gradients (docs/equivalence.md §2).

Both trainers are built from the same initial variables and fed the same N
per-tower batches, already preprocessed. Compared:

1. the averaged gradients at the initial variables, per variable:
   max|a - b| / max|b| <= GRAD_RTOL;
2. the per-tower total losses, relative, <= LOSS_RTOL;
3. the variables and their moving averages after K training steps on those
   batches (learning-rate schedule and EMA included), relative, <= FINAL_RTOL
   (with Adam: median|a - b| / the K steps' summed learning rate <= ADAM_LR_TOL);
4. the identity: N towers on b1..bN give the averaged gradient of 1 tower on
   their concatenation, <= GRAD_RTOL, in each implementation. This is what
   proves the averaging is a true mean and weight decay is counted once.

With an optimizer other than SGD (common.optimizer), 3 also compares every
slot (momentum accumulators, Adam's m, v and beta powers) after K steps,
relative, <= FINAL_RTOL (Adam's: median|a - b| / max|b| <= ADAM_SLOT_RTOL);
with --clip_norm, 1 also compares the clipped averaged gradient (what the
optimizer applies), and 4 compares the clipped gradients. With --clip_where
per_tower, 4 does not hold (clipping each tower by its own norm is not
clipping the mean): its rows are reported, with the measured difference, and
not held to a tolerance.

`run()` returns a `Report`; `write_evidence()` writes the file of docs/equivalence.md §2 that
anyone can re-check with their own code.
"""

import dataclasses
import functools
import logging
import math
import os

import numpy as np

from cifar10_towers import convert
from cifar10_towers.common import cifar10_format as fmt
from cifar10_towers.common import files
from cifar10_towers.common import hparams
from cifar10_towers.common import model_spec
from cifar10_towers.common import optimizer as optimizer_lib
from cifar10_towers.runtime import config as config_lib

logger = logging.getLogger(__name__)

GRAD_RTOL = 1e-5  # contract 1 and 4: averaged gradients, relative to max|g|
LOSS_RTOL = 1e-6  # contract 2: per-tower total losses
FINAL_RTOL = 1e-4  # contract 3: variables, moving averages and slots after K steps
# Contract 3 with Adam, whose steps rounding can steer (docs/equivalence.md §2, "After K steps"):
ADAM_LR_TOL = 1e-2  # variables and moving averages: median element, in the K steps' summed lr
ADAM_SLOT_RTOL = 1e-2  # m, v and the beta powers: median element, relative to max|slot|


def rel_diff(a, b, scale=None, stat=np.max):
  """stat(|a - b|) / scale; by default max|a - b| / max|b| (0 when both are all zero)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  diff = stat(np.abs(a - b))
  scale = np.max(np.abs(b)) if scale is None else scale
  return float(diff / scale) if scale else (0.0 if diff == 0.0 else np.inf)


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
    while (bad := np.abs(w) > 2.0).any():
      w[bad] = rng.standard_normal(int(bad.sum()))
    values[f'{layer.name}/weights'] = (w * layer.stddev).astype(np.float32)
    values[f'{layer.name}/biases'] = np.full(layer.weight_shape[-1:],
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
  from cifar10_towers.common import preprocess  # pylint: disable=g-import-not-at-top
  n = num_towers * batch_size
  rng = np.random.default_rng(seed)
  if data_dir is None:
    from cifar10_towers.datasets import synth  # pylint: disable=g-import-not-at-top
    labels = rng.permutation(np.arange(n) % hparams.NUM_CLASSES).astype(np.int32)
    raw = synth.make_images(rng, labels)
  else:
    # Only as many files as the draw needs: CIFAR-10's five hold 150 MB.
    records = []
    for path in fmt.train_files(data_dir):
      records.append(fmt.read_records(path))
      if sum(len(file_labels) for _, file_labels in records) >= n:
        break
    raw, labels = (np.concatenate(parts) for parts in zip(*records))
    if len(labels) < n:
      raise fmt.DataError(f'{data_dir} holds {len(labels)} training records; the cross-check '
                          f'needs {n} (num_gpus x batch_size).')
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
  applied: dict  # the averaged gradient as applied: clipped if asked
  tower_losses: list  # [N] total loss of each tower
  final: dict  # variable name -> value after K steps
  final_ema: dict  # variable name -> moving average after K steps
  final_slots: dict  # optimizer slot name -> value after K steps
  single_tower_grads: dict = None  # 1 tower on the concatenated batches (clipped if asked)


@dataclasses.dataclass
class Report:
  """The comparison, with each figure and its tolerance."""
  rows: list  # (check, variable, measured, tolerance)
  legacy: Result
  modern: Result
  optimizer: optimizer_lib.Optimizer

  @property
  def passed(self):
    return not self.failures()

  def per_tower_identity_gap(self):
    """Max over variables and implementations of the identity rows not held
    (--clip_where per_tower), or None when there are none."""
    return max((row[2] for row in self.rows if row[3] == NOT_HELD), default=None)

  def failures(self):
    return [row for row in self.rows if not row[2] <= row[3]]


NOT_HELD = math.inf  # the tolerance of a row reported but not held to one


def lr_sum(optimizer, steps, decay_steps):
  """The learning rates of K steps summed: about the farthest K Adam steps move an element."""
  return sum(optimizer.learning_rate * hparams.LEARNING_RATE_DECAY_FACTOR ** (k // decay_steps)
             for k in range(steps))


def compare(legacy, modern, optimizer, lr_total, grad_rtol=GRAD_RTOL):
  """Builds the Report rows of docs/equivalence.md §2 from two Results.

  lr_total: `lr_sum` of the K steps, the unit of Adam's variable rows.
  grad_rtol: the tolerance of the averaged gradients and the identity (--rtol).
  """
  names = model_spec.VARIABLE_NAMES
  rows = []

  def add(check, field, tol, keys=names, scale=None, stat=np.max):
    """A row per key of legacy's and modern's `field`: rel_diff(legacy, modern, scale, stat)."""
    rows.extend((check, key, rel_diff(getattr(legacy, field)[key], getattr(modern, field)[key],
                                      scale, stat), tol) for key in keys)

  add('1 averaged gradient', 'grads', grad_rtol)
  if optimizer.clips_averaged:
    add('1 clipped averaged gradient', 'applied', grad_rtol)
  rows += [('2 tower loss', f'tower_{i}', rel_diff(a, b), LOSS_RTOL)
           for i, (a, b) in enumerate(zip(legacy.tower_losses, modern.tower_losses))]
  slots = optimizer.slot_names()
  if optimizer.name == optimizer_lib.ADAM:
    # Rounding can steer an Adam step by up to ~lr per element (a max-pool
    # tie flipped, a rounding-sized gradient): its median element is held, the
    # variables in units of the K steps' summed lr (docs/equivalence.md §2).
    add('3 variable after K steps [median / sum lr]', 'final', ADAM_LR_TOL, scale=lr_total,
        stat=np.median)
    add('3 moving average after K steps [median / sum lr]', 'final_ema', ADAM_LR_TOL,
        scale=lr_total, stat=np.median)
    add('3 slot after K steps [median]', 'final_slots', ADAM_SLOT_RTOL, slots, stat=np.median)
  else:
    add('3 variable after K steps', 'final', FINAL_RTOL)
    add('3 moving average after K steps', 'final_ema', FINAL_RTOL)
    add('3 slot after K steps', 'final_slots', FINAL_RTOL, slots)
  # Per-tower clipping breaks the identity by design: reported, not held.
  mark, tol = (' [per_tower]', NOT_HELD) if optimizer.clips_per_tower else ('', grad_rtol)
  rows += [(f'4 identity ({impl}): N towers vs 1 on concat{mark}', name,
            rel_diff(result.applied[name], result.single_tower_grads[name]), tol)
           for impl, result in (('legacy', legacy), ('modern', modern)) for name in names]
  return Report(rows, legacy, modern, optimizer)


def format_report(report):
  """The per-variable table, one row per figure, then the verdict."""
  lines = [f'{"check":56} {"variable / tower":32} {"rel diff":>11} {"tolerance":>9}  ']
  for check, name, measured, tol in report.rows:
    if tol == NOT_HELD:
      tol_shown, verdict = '-', 'not held'
    else:
      tol_shown, verdict = f'{tol:.0e}', 'ok' if measured <= tol else 'FAIL'
    lines.append(f'{check:56} {name:32} {measured:11.3e} {tol_shown:>9}  {verdict}')
  gap = report.per_tower_identity_gap()
  if gap is not None:
    lines.append('Note: with --clip_where per_tower, N towers are NOT 1 tower on the '
                 'concatenation: each tower is clipped by its own norm, which is '
                 'not clipping their mean; the applied gradients differ by up to '
                 f'{gap:.3e} (max|a-b|/max|b|) on these batches. --clip_where averaged '
                 'keeps the identity.')
  failed = len(report.failures())
  lines.append(f'FAIL: {failed} of {len(report.rows)} figures outside the contract.' if failed
               else f'PASS: all {len(report.rows)} figures within the contract '
               '(docs/equivalence.md §2).')
  return '\n'.join(lines)


def write_evidence(path_dir, images, labels, init, report):
  """Writes `<dir>/crosscheck.npz` in the format of docs/equivalence.md §2, whole or not at all.

  Raises:
    common.files.WriteError: it could not be written (a full disk, say).
  """
  os.makedirs(path_dir, exist_ok=True)
  arrays = {'images': images, 'labels': labels}  # float32, int32 (draw_batches)
  arrays.update((f'init/{name}', value) for name, value in init.items())
  groups = {'grad': 'grads', 'final': 'final', 'slot': 'final_slots'}  # key -> Result field
  if report.optimizer.clips_averaged:
    groups['clipped_grad'] = 'applied'
  for impl, result in (('legacy', report.legacy), ('modern', report.modern)):
    arrays[f'{impl}/tower_loss'] = np.asarray(result.tower_losses, np.float32)
    for what, field in groups.items():
      arrays.update((f'{impl}/{what}/{key}', np.asarray(value, np.float32))
                    for key, value in getattr(result, field).items())
  path = os.path.join(path_dir, 'crosscheck.npz')
  with files.replacing('--dump', path) as [temp]:
    np.savez(temp, **arrays)
  return path


def _legacy_run(plan, images, labels, steps, init, decay_steps, optimizer):
  """Legacy's averaged (and applied) gradients, tower losses, and state after `steps` steps.

  The graph is legacy's own `build_towers`, fed constants instead of the
  prefetch queue (convert.legacy_session); the variables and their moving
  averages start at `init`, the optimizer's slots as TF1 creates them.
  """
  shadows = {model_spec.average_name(name): value for name, value in init.items()}
  with convert.legacy_session(images, labels, plan, decay_steps, optimizer,
                              {**init, **shadows}) as (sess, towers, variables):
    start = sess.run([{v.op.name: g for g, v in gv}
                      for gv in (towers.averaged_grads, towers.applied_grads)]
                     + [towers.tower_losses])
    for _ in range(steps):
      sess.run(towers.train_op)
    names = model_spec.VARIABLE_NAMES
    return Result(*start, *sess.run([{n: variables[n] for n in names},
                                     {n: towers.ema.average(variables[n]) for n in names},
                                     {n: variables[n] for n in optimizer.slot_names()}]))


def _modern_run(engine, plan, images, labels, steps, init, decay_steps, optimizer):
  """The same with a modern engine's step.

  engine: 'towers' (modern's own tf.function towers) or 'mirrored' (the same
  step under tf.distribute.MirroredStrategy; 'multiworker' needs several
  processes and has its own test).
  """
  from cifar10_towers.modern import engines  # pylint: disable=g-import-not-at-top
  trainer = engines.make(config_lib.TrainConfig(
      num_gpus=plan.num_towers, strategy=engine, optimizer=optimizer), plan).build(decay_steps)
  state = trainer.state
  state.assign_variables(init)
  grads, losses = trainer.compute_gradients((images, labels))
  # What the step applies: the engine's own clipping of these gradients.
  applied = _numpy(dict(zip(grads, state.clip_averaged(list(grads.values())))))
  grads = _numpy(grads)
  for _ in range(steps):
    trainer.train_step((images, labels))
  return Result(grads, applied, np.asarray(losses), *map(_numpy, (
      state.variables(), state.shadow_variables(), state.slot_variables())))


def _numpy(tensors):
  return {name: np.asarray(value) for name, value in tensors.items()}


def run(plan, batch_size=16, steps=5, seed=0, data_dir=None, decay_steps=2,
        engines=('towers',), grad_rtol=GRAD_RTOL, optimizer=optimizer_lib.Optimizer()):
  """Runs the whole cross-check.

  Args:
    plan: common.devices.DevicePlan; N = plan.num_towers towers.
    batch_size: images per tower.
    steps: K, training steps before comparing variables and moving averages.
    seed: seeds the batches and the initial variables.
    data_dir: draw the batches from this data dir; None = generated data.
    decay_steps: learning-rate decay interval; small by default so that K
      steps cross the staircase.
    engines: the modern engines to compare with legacy ('towers', 'mirrored';
      `_modern_run`); with several, each is held to the same contract against
      legacy, which makes the comparison N-way.
    grad_rtol: the tolerance of the averaged gradients and the identity;
      GRAD_RTOL, the contract's, unless asked (--rtol).
    optimizer: common.optimizer.Optimizer both trainers use (default
      upstream's SGD, no clipping).

  Returns:
    (dict engine -> Report, images [N,B,24,24,3], labels [N,B], initial
     variables dict).
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  # On GPUs (docs/equivalence.md §3): no TF32 (10-bit) matmuls and
  # convolutions, and cuDNN's default algorithms, not autotuned ones, which
  # differed between the two trainers' runs on an H100. Read at the
  # process's first convolution: a --crosscheck run trains with it too.
  tf.config.experimental.enable_tensor_float_32_execution(False)
  os.environ['TF_CUDNN_USE_AUTOTUNE'] = '0'
  images, labels = draw_batches(plan.num_towers, batch_size, seed, data_dir)
  init = initial_values(seed)
  single_tower = dataclasses.replace(plan, tower_devices=plan.tower_devices[:1])

  def result(name, run_one):
    """run_one's Result on the N towers, with the identity's 1 tower on their concatenation."""
    logger.info(f'{name}: {plan.num_towers} tower(s) x {batch_size} images, {steps} steps...')
    return dataclasses.replace(
        run_one(plan, images, labels, steps, init, decay_steps, optimizer),
        single_tower_grads=run_one(single_tower, images.reshape((1, -1) + images.shape[2:]),
                                   labels.reshape(1, -1), 0, init, decay_steps, optimizer).applied)

  legacy = result('legacy', _legacy_run)
  lr_total = lr_sum(optimizer, steps, decay_steps)
  reports = {engine: compare(legacy, result(f'modern ({engine})',
                                            functools.partial(_modern_run, engine)),
                             optimizer, lr_total, grad_rtol)
             for engine in engines}
  return reports, images, labels, init
