"""The cross-check: legacy and modern compute the same thing (docs/equivalence.md §2).

Both trainers are built once and fed the same N per-tower batches, already
preprocessed. Each of K training steps starts, in both, from the same full
state: the variables, their moving averages, every optimizer slot (Adam's beta
powers too) and the global step, legacy's state after the step before. At
every step:

1. the averaged gradients (and, with --clip_where averaged, the clipped ones
   the optimizer applies), per variable: max|a - b| / max|b| <= GRAD_RTOL;
2. the per-tower total losses, relative, <= LOSS_RTOL;
3. the step's update (state after minus state before) of every variable,
   moving average, slot and the global step, element by element, against its
   largest element: <= UPDATE_RTOL beyond the float32 spacing of the value it
   lands on (a moving average also beyond 1 - decay times its variable's
   difference, which the variable's row holds). With Adam the variables are
   held per element to ADAM_LR_RTOL of the step's learning rate beyond lr x
   their gradients' difference / epsilon: a rounding-sized gradient steers
   part of an lr-sized step;
4. the identity, at the first step's state: N towers on b1..bN give the
   averaged gradient of 1 tower on their concatenation, <= GRAD_RTOL, in each
   implementation (with --clip_where per_tower reported, not held: clipping
   each tower by its own norm is not clipping the mean).

The K steps also run free, each trainer on its own from the first state; their
drift is reported with no verdict (two free trajectories part by chance: a
max-pool tie an ulp flips). When a step fails, `Report.parting` says where the
trainers first part at that step (`_parting`).

`run()` returns a `Report` per modern engine; `write_evidence()` writes the file of
docs/equivalence.md §2 that anyone can re-check with their own code.
"""

import collections
import contextlib
import dataclasses
import logging
import os
import re

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
LOSS_RTOL = 1e-6  # contract 2: per-tower total losses; also each layer's output (_parting)
UPDATE_RTOL = 1e-5  # contract 3: a step's update, relative to its largest element
ADAM_LR_RTOL = 1e-3  # contract 3, Adam's variables: per element, in the step's lr


def rel_diff(a, b, scale=None, stat=np.max):
  """stat(|a - b|) / scale; by default max|a - b| / max|b| (0 when both are all zero)."""
  diff = stat(_gap(a, b))
  scale = np.max(np.abs(b)) if scale is None else scale
  return float(diff / scale) if scale else (0.0 if diff == 0.0 else np.inf)


def _gap(a, b):
  """|a - b| in float64."""
  return np.abs(np.subtract(a, b, dtype=np.float64))


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
      w[bad] = rng.standard_normal(bad.sum())
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
    labels = rng.permutation(np.arange(n) % hparams.NUM_CLASSES)
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
    raw, labels = raw[pick], labels[pick]
  tf.random.set_seed(seed)
  distorted = np.stack([preprocess.distort_image(tf.constant(image)).numpy()
                        for image in raw])
  return (distorted.reshape(num_towers, batch_size, hparams.IMAGE_SIZE,
                            hparams.IMAGE_SIZE, 3),
          labels.astype(np.int32).reshape(num_towers, batch_size))



# One figure of the table: measured against tolerance, at the worst step (and seed) it had.
Row = collections.namedtuple('Row', 'check name measured tolerance step seed',
                             defaults=(None, None))
# One step of one trainer: averaged gradients, as applied (clipped if asked),
# tower losses [N], and the full state after it (None: gradients only).
Step = collections.namedtuple('Step', 'grads applied tower_losses state')
NOT_HELD = np.inf  # the tolerance of a row reported but not held to one


@dataclasses.dataclass
class Result:
  """What one implementation computed on the cross-check's inputs."""
  steps: list  # Step of each of the K steps, each from the shared state (K = 0: one, no update)
  # Full state after K free-running steps (legacy names, as `initial_state`); False: not run
  # (modern's, in a sweep).
  final: dict
  single_tower_grads: dict  # 1 tower on the concatenated batches (clipped if asked)
  grads = property(lambda self: self.steps[0].grads)  # at the first state
  applied = property(lambda self: self.steps[0].applied)
  tower_losses = property(lambda self: self.steps[0].tower_losses)


@dataclasses.dataclass
class Report:
  """The comparison of legacy with one modern engine, with each figure and its tolerance."""
  rows: list  # Row
  legacy: Result
  modern: Result
  optimizer: optimizer_lib.OptimizerSpec
  parting: str = None  # where the trainers part at the first failed step (None: none failed)
  drift: list = ()  # (name, largest, median element of |a - b| / max|b|) of the free run

  passed = property(lambda self: not self.failures())

  def per_tower_identity_gap(self):
    """Max over variables and implementations of the identity rows not held
    (--clip_where per_tower), or None when there are none."""
    return max((row.measured for row in self.rows if row.tolerance == NOT_HELD), default=None)

  def failures(self):
    return _failures(self.rows)


def _failures(rows):
  return [row for row in rows if not row.measured <= row.tolerance]


def initial_state(init, optimizer):
  """The full state of a fresh start from variables `init`, as both trainers create it."""
  return {**init, **{model_spec.average_name(n): v for n, v in init.items()},
          **{name: np.full(optimizer_lib.slot_shape(name), optimizer.initial_value(name),
                           np.float32)
             for name in optimizer.slot_names()}, 'global_step': np.int64(0)}


def _update_rows(before, legacy_step, modern_step, optimizer, decay_steps):
  """Contract 3's rows of one step, in _parting's order (variables, slots, the global
  step, moving averages): each state entry's update, legacy's Step against modern's."""
  step = int(before['global_step'])
  lr = optimizer.learning_rate * hparams.LEARNING_RATE_DECAY_FACTOR ** (step // decay_steps)
  ema = 1.0 - min(hparams.MOVING_AVERAGE_DECAY, (2.0 + step) / (11.0 + step))  # the new step's
  a, b = legacy_step.state, modern_step.state
  variables, rows = model_spec.VARIABLE_NAMES, []
  # A full state's entries by kind, in _parting's order.
  for what, names in (('variable', variables), ('slot', optimizer.slot_names()),
                      ('global step', ['global_step']),
                      ('moving average', map(model_spec.average_name, variables))):
    for name in names:
      var = name.split('/Exp')[0]
      # Float32 stores each result rounded: one spacing of the value apart is no difference.
      excess = _gap(a[name], b[name]) - np.spacing(np.float32(np.abs(b[name])))
      if what == 'moving average':  # 1 - decay carries its variable's difference into it
        excess -= ema * _gap(a[var], b[var])
      if optimizer.name == optimizer_lib.ADAM and what == 'variable':
        # Adam: a rounding-sized gradient steers part of an lr step. An Adam step moves at
        # most lr / epsilon per unit of gradient, so the gradients' own difference may move
        # it that much more.
        excess -= lr * _gap(legacy_step.applied[var], modern_step.applied[var]) / (
            optimizer.adam_epsilon)
        scale, tol, check = lr, ADAM_LR_RTOL, what + ' [of lr]'
      else:
        scale, tol, check = np.max(_gap(b[name], before[name])), UPDATE_RTOL, what
      rows.append(Row(f'3 step update: {check}', name,
                      rel_diff(np.maximum(excess, 0.0), 0.0, scale), tol))
  return rows


def _step_rows(legacy, modern, before, optimizer, decay_steps, grad_rtol):
  """Contract 1-3's rows of one step (Steps of both trainers from the state `before`)."""
  pairs = [('averaged gradient', legacy.grads, modern.grads)]
  if optimizer.clips_averaged:
    pairs.append(('clipped averaged gradient', legacy.applied, modern.applied))
  rows = [Row(f'1 {check}', n, rel_diff(a[n], b[n]), grad_rtol)
          for check, a, b in pairs for n in model_spec.VARIABLE_NAMES]
  rows += [Row('2 tower loss', f'tower_{i}', rel_diff(a, b), LOSS_RTOL)
           for i, (a, b) in enumerate(zip(legacy.tower_losses, modern.tower_losses))]
  if legacy.state is not None:
    rows += _update_rows(before, legacy, modern, optimizer, decay_steps)
  return rows


def worst(rows):
  """One row per figure (check, name) of several steps' or seeds' rows: its worst one."""
  kept = {}
  for row in rows:
    key = row.check, row.name
    if not row.measured <= kept.setdefault(key, row).measured:  # a worse one, or a NaN
      kept[key] = row
  return list(kept.values())


def compare(legacy, modern, optimizer, starts, decay_steps, grad_rtol, where):
  """Builds the Report rows of docs/equivalence.md §2 from two Results.

  starts: the full state each step started from (legacy's before it).
  grad_rtol: the tolerance of the averaged gradients and the identity (--rtol).
  where: callable(step k, its rows) -> the line naming where the trainers part
    at step k (`_parting`), called only if a step failed.
  """
  steps = [_step_rows(a, b, start, optimizer, decay_steps, grad_rtol)
           for a, b, start in zip(legacy.steps, modern.steps, starts)]
  rows = worst([row._replace(step=k) for k, step in enumerate(steps, 1) for row in step])
  # Per-tower clipping breaks the identity by design: reported, not held.
  mark, tol = (' [per_tower]', NOT_HELD) if optimizer.clips_per_tower else ('', grad_rtol)
  rows += [Row(f'4 identity ({impl}): N towers vs 1 on concat{mark}', name,
               rel_diff(result.applied[name], result.single_tower_grads[name]), tol)
           for impl, result in (('legacy', legacy), ('modern', modern))
           for name in model_spec.VARIABLE_NAMES]
  drift = [(name, *(rel_diff(legacy.final[name], modern.final[name], stat=stat)
                    for stat in (np.max, np.median)))
           for name in model_spec.VARIABLE_NAMES + optimizer.slot_names() if modern.final]
  return Report(rows, legacy, modern, optimizer, next(
      (where(k, step) for k, step in enumerate(steps, 1) if _failures(step)), None), drift)


def format_report(report):
  """The line naming where the trainers part (if a step failed), the table of every
  figure at its worst step, the free run's drift, then the verdict."""
  lines = [report.parting] if report.parting else []
  lines.append(f'{"check":46} {"variable / tower":48} {"rel diff":>10} {"tolerance":>9}  worst at')
  for row in report.rows:
    if row.tolerance == NOT_HELD:
      tol_shown, verdict = '-', 'not held'
    else:
      tol_shown, verdict = f'{row.tolerance:.0e}', 'ok' if row.measured <= row.tolerance else 'FAIL'
    at = ' '.join(f'{what} {n}' for what, n in (('step', row.step), ('seed', row.seed))
                  if n is not None)
    lines.append(f'{row.check:46} {row.name:48} {row.measured:10.3e} {tol_shown:>9}  {verdict:8} {at}')
  gap = report.per_tower_identity_gap()
  if gap is not None:
    lines.append('Note: with --clip_where per_tower, N towers are NOT 1 tower on the '
                 'concatenation: each tower is clipped by its own norm, which is '
                 'not clipping their mean; the applied gradients differ by up to '
                 f'{gap:.3e} (max|a-b|/max|b|) on these batches. --clip_where averaged '
                 'keeps the identity.')
  if report.drift:
    lines.append('Drift of the free run, each trainer K steps on its own: reported, not judged '
                 '(two free runs part by chance, docs/equivalence.md §2). max|a-b|/max|b|, '
                 'largest and median element:')
    lines += [f'  {name:48} {largest:10.3e} {median:10.3e}' for name, largest, median in report.drift]
  failed = len(report.failures())
  lines.append(f'FAIL: {failed} of {len(report.rows)} figures outside the contract.' if failed
               else f'PASS: all {len(report.rows)} figures within the contract '
               '(docs/equivalence.md §2).')
  return '\n'.join(lines)


def write_evidence(path_dir, images, labels, init, reports):
  """Writes `<dir>/crosscheck.npz` in the format of docs/equivalence.md §2, whole or not at all.

  reports: dict engine -> Report; 'modern/...' keys are the first engine's.

  Raises:
    common.files.WriteError: it could not be written (a full disk, say).
  """
  os.makedirs(path_dir, exist_ok=True)
  arrays = {'images': images, 'labels': labels}  # float32, int32 (draw_batches)
  first = next(iter(reports.values()))
  optimizer = first.optimizer

  def put(prefix, got=None, **groups):
    """`groups` under prefix, with the tower losses and gradients of `got` (a Step or Result)."""
    if got:
      arrays[f'{prefix}tower_loss'] = np.asarray(got.tower_losses, np.float32)
      groups['grad'] = got.grads
      if optimizer.clips_averaged:
        groups['clipped_grad'] = got.applied
    arrays.update((f'{prefix}{what}/{key}', np.asarray(value))
                  for what, values in groups.items() for key, value in values.items())

  put('', init=init)
  for impl, result in (('legacy', first.legacy), ('modern', first.modern)):
    put(f'{impl}/', result, final={n: result.final[n] for n in init},
        slot={n: result.final[n] for n in optimizer.slot_names()})
  # Per step: the state both started from (legacy's after the step before), then what
  # each trainer computed from it.
  impls = {'legacy': first.legacy, **{engine: r.modern for engine, r in reports.items()}}
  starts = [initial_state(init, optimizer)] + [step.state for step in first.legacy.steps]
  for k, start in enumerate(starts[:-1], 1):
    put(f'step/{k}/', start=start)
    for impl, result in impls.items():
      got = result.steps[k - 1]
      put(f'step/{k}/{impl}/', got, state=got.state or {})
  path = os.path.join(path_dir, 'crosscheck.npz')
  with files.replacing('--dump', path) as [temp]:
    np.savez_compressed(temp, **arrays)
  return path


_LAYER_OUTPUTS = ('conv1', 'pool1', 'norm1', 'conv2', 'norm2', 'pool2', 'local3', 'local4',
                  'softmax_linear')


def _layer_outputs(graph, scope):
  """Each layer's output of model_spec.forward built under name scope `scope`, in order.

  Found by op name, in legacy's graph and in a modern tf.function's alike: the
  layers and pools are named ops ('tower_0/conv1', or 'conv1_1' where legacy's
  variable scope took the name); a norm's output is what the next layer reads.
  """
  named = {}
  for op in graph.get_operations():
    layer = re.sub(r'_\d+$', '', op.name[len(scope):])
    if op.name.startswith(scope) and layer in _LAYER_OUTPUTS and op.type != 'NoOp':
      named.setdefault(layer, op.outputs[0])
  # conv2 = relu(bias_add(conv2d(norm1, w), b)); pool2 = max_pool(norm2).
  named['norm1'] = named['conv2'].op.inputs[0].op.inputs[0].op.inputs[0]
  named['norm2'] = named['pool2'].op.inputs[0]
  return [named[layer] for layer in _LAYER_OUTPUTS]


class _Legacy:
  """Legacy's own graph (`convert.legacy_session`), built once, fed the batches and state."""
  _detail = None  # `detail`'s fetches, built at the first failure only

  def __init__(self, stack, plan, batch_size, decay_steps, optimizer):
    self.plan = plan
    self.sess, self.towers, self.variables, self.inputs = stack.enter_context(
        convert.legacy_session([plan.num_towers, batch_size], plan, decay_steps, optimizer, {}))

  def _run(self, fetches, state, batches):
    convert.set_values(self.sess, self.variables, state)
    return self.sess.run(fetches, dict(zip(self.inputs, batches)))

  def step(self, state, batches, update):
    """A Step from `state` on these batches (images [N, B, 24, 24, 3], labels [N, B])."""
    towers = self.towers
    grads = [{v.op.name: g for g, v in gv} for gv in (towers.averaged_grads, towers.applied_grads)]
    *grads, losses, _ = self._run(grads + [towers.tower_losses, towers.train_op if update else []],
                                  state, batches)
    return Step(*grads, losses, self.sess.run(self.variables) if update else None)  # the full state

  def detail(self, state, batches):
    """`_parting`'s arrays from `state`: each tower's layer outputs and loss, its gradients,
    and its gradients as they enter the average (clipped with --clip_where per_tower)."""
    import tensorflow.compat.v1 as tf1  # pylint: disable=g-import-not-at-top
    if self._detail is None:
      variables = [self.variables[n] for n in reversed(model_spec.VARIABLE_NAMES)]
      outputs, grads = [], []
      with self.sess.graph.as_default():
        for i, loss in enumerate(self.towers.tower_losses):
          outputs += _layer_outputs(self.sess.graph, f'{hparams.TOWER_NAME}_{i}/') + [loss]
          with tf1.device(self.plan.tower_devices[i]):
            grads += tf1.gradients(loss, variables)
      # average_gradients: reduce_mean(concat([expand_dims(tower grad, 0), ...]), 0), where
      # the concat of one tower is an identity.
      entering = [[part.op.inputs[0] for part in grad.op.inputs[0].op.inputs
                   if part.op.type == 'ExpandDims']
                  for grad, _ in reversed(self.towers.averaged_grads)]
      self._detail = outputs + grads + [g for tower in zip(*entering) for g in tower]
    return self._run(self._detail, state, batches)


class _Modern:
  """A modern engine's step ('towers': modern's own tf.function towers; 'mirrored': the same
  step under tf.distribute.MirroredStrategy), built once, assigned each state."""
  _detail = None  # `detail`'s traced function, made at the first failure only

  def __init__(self, engine, plan, decay_steps, optimizer):
    from cifar10_towers.modern import engines  # pylint: disable=g-import-not-at-top
    self.plan = plan
    self.trainer = engines.ENGINES[engine](config_lib.TrainConfig(
        num_gpus=plan.num_towers, strategy=engine, optimizer=optimizer), plan).build(decay_steps)
    self.variables = convert.modern_variables(self.trainer.state)

  def _set(self, state):
    for name, var in self.variables.items():
      var.assign(state[name])

  def step(self, state, batches, update):
    self._set(state)
    # With `update`, the training step itself, which returns the gradients it applied.
    grads, losses = self.trainer.compute_gradients(batches, apply=update)
    # What the step applies: the engine's own clipping of these gradients.
    applied = dict(zip(grads, self.trainer.state.clip_averaged(list(grads.values()))))
    return Step(_numpy(grads), _numpy(applied), np.asarray(losses),
                _numpy(self.variables) if update else None)

  def detail(self, state, batches):
    """As _Legacy.detail, through modern.step's public tower_loss and the state's clipping."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    from cifar10_towers.modern import step as modern_step  # pylint: disable=g-import-not-at-top
    target = self.trainer.state

    def towers(images, labels):
      outputs, grads, entering = [], [], []
      for i, device in enumerate(self.plan.tower_devices):
        with tf.device(device), tf.name_scope(f'{hparams.TOWER_NAME}_{i}') as scope:
          loss = modern_step.tower_loss(target.model, images[i], labels[i])
          # Graph gradients of the variables themselves (the step's are of their values,
          # read once on the variable device: the same arithmetic).
          tower = tf.gradients(loss, target.model.variable_list())
          outputs += _layer_outputs(tf.compat.v1.get_default_graph(), scope) + [loss]
          grads += reversed(tower)
          entering += reversed(target.clip_tower(tower, 1.0))
      return outputs + grads + entering

    self._detail = self._detail or tf.function(towers, autograph=False)
    self._set(state)
    return self._detail(*batches)


def _numpy(tensors):
  return {name: np.asarray(value) for name, value in tensors.items()}


def _parting(engine, k, rows, legacy, modern, *inputs):
  """The line naming where legacy and a modern engine first part at step k, in the order
  of docs/equivalence.md §2: each tower's layer outputs and loss, its gradients
  backward, per-tower clipping (`detail`), then `rows` of the step (averaging,
  averaged clipping, the update: variables, slots; the moving averages).

  inputs: the state step k started from, its batches (images, labels).
  """
  towers, names = range(legacy.plan.num_towers), [*reversed(model_spec.VARIABLE_NAMES)]
  places = ([(f"{layer}'s output on tower {i}" if layer else f"tower {i}'s loss", LOSS_RTOL)
             for i in towers for layer in _LAYER_OUTPUTS + (None,)]
            + [(f"tower {i}'s gradient of {n}", GRAD_RTOL) for i in towers for n in names]
            + [(f'per-tower clipping of {n} on tower {i}', GRAD_RTOL) for i in towers
               for n in names])
  parted = _failures(
      [Row(place, None, rel_diff(a, b), tol) for (place, tol), a, b in zip(
          places, legacy.detail(*inputs), modern.detail(*inputs))]
      + [row._replace(check=f'the {row.check[2:]} of {row.name}' if row.check[0] == '1' else
                      f'the moving average of {row.name.rsplit("/", 1)[0]}'
                      if 'moving average' in row.check else f'the update of {row.name}')
         for row in rows if row.check[0] in '13'])  # averaging, averaged clipping, update
  first = parted[0] if parted else Row('no place checked (see the table)', None, 0.0, 0.0)
  return (f'modern ({engine}) parts from legacy at step {k}: {first.check}, '
          f'{first.measured:.1e} apart')


def run(plan, batch_size=16, steps=5, seed=0, data_dir=None, decay_steps=2,
        engines=('towers',), grad_rtol=GRAD_RTOL, optimizer=optimizer_lib.OptimizerSpec(),
        seeds=1, draws=None):
  """Runs the whole cross-check.

  Args:
    plan: common.devices.DevicePlan; N = plan.num_towers towers.
    batch_size: images per tower.
    steps: K, training steps, each compared from the same state (0: the
      gradients, losses and identity at the initial variables only).
    seed: seeds the batches and the initial variables.
    data_dir: draw the batches from this data dir; None = generated data.
    decay_steps: learning-rate decay interval; small by default so that K
      steps cross the staircase.
    engines: the modern engines to compare with legacy ('towers', 'mirrored';
      `_Modern`); with several, each is held to the same contract against
      legacy, which makes the comparison N-way.
    grad_rtol: the tolerance of the averaged gradients and the identity;
      GRAD_RTOL, the contract's, unless asked (--rtol).
    optimizer: common.optimizer.OptimizerSpec both trainers use (default
      upstream's SGD, no clipping).
    seeds: check seeds seed .. seed + seeds - 1 on one build (a sweep), each
      said in a line; the Reports then hold each figure's worst seed.
    draws: instead of seed, seeds and data_dir, the checks to run on the one
      build: (seed, data_dir, the engines checked at it) each (the suite's
      random draws: each engine at its own seeds, on two data sets). Several
      draws are a sweep, as several seeds: a line per draw and engine, each
      figure at its worst seed, and no free run (no drift, no evidence file).

  Returns:
    (dict engine -> Report, images [N,B,24,24,3], labels [N,B], initial
     variables dict), the batches and variables of the last seed.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  # On GPUs (docs/equivalence.md §3): no TF32 (10-bit) matmuls and
  # convolutions, and cuDNN's default algorithms, not autotuned ones, which
  # differed between the two trainers' runs on an H100. Read at the
  # process's first convolution: a --crosscheck run trains with it too.
  tf.config.experimental.enable_tensor_float_32_execution(False)
  os.environ['TF_CUDNN_USE_AUTOTUNE'] = '0'
  single = dataclasses.replace(plan, tower_devices=plan.tower_devices[:1])
  n, update = plan.num_towers, steps > 0
  with contextlib.ExitStack() as stack:
    # Built once, for N towers and for 1 (the identity); each seed's state is assigned.
    legacy = _Legacy(stack, plan, batch_size, decay_steps, optimizer)
    legacy_one = _Legacy(stack, single, n * batch_size, decay_steps, optimizer)
    modern = {e: [_Modern(e, p, decay_steps, optimizer) for p in (plan, single)] for e in engines}
    draws = draws or [(seed, data_dir, engines) for seed in range(seed, seed + seeds)]
    merged = {}
    for seed, data_dir, chosen in draws:
      batches = draw_batches(n, batch_size, seed, data_dir)
      init = initial_values(seed)
      concat = [x.reshape(1, -1, *x.shape[2:]) for x in batches]
      logger.info(f'legacy: {n} tower(s) x {batch_size} images, {steps} steps...')
      # Legacy's steps, each from the state the one before reached: its free run too.
      starts, taken = [initial_state(init, optimizer)], []
      for _ in range(max(steps, 1)):
        taken.append(legacy.step(starts[-1], batches, update))
        starts.append(taken[-1].state or starts[0])
      reference = Result(taken, starts[-1], legacy_one.step(starts[0], concat, False).applied)
      for engine in chosen:
        towers, one = modern[engine]
        logger.info(f'modern ({engine}): {n} tower(s) x {batch_size} images, {steps} steps...')
        # Its free run: K training steps from the first state, each from the one before.
        # Only one draw runs free: a sweep (several draws) reports no drift and writes no
        # evidence (`crosscheck --dump` refuses --seeds).
        free = len(draws) == 1 and starts[0]
        for _ in range(steps if free else 0):
          free = towers.step(free, batches, True).state
        result = Result([towers.step(start, batches, update) for start in starts[:-1]],
                        free, one.step(starts[0], concat, False).applied)
        report = compare(
            reference, result, optimizer, starts, decay_steps, grad_rtol,
            lambda k, rows: _parting(engine, k, rows, legacy, towers,  # pylint: disable=cell-var-from-loop
                                     starts[k - 1], batches))
        if len(draws) > 1:  # a sweep: a line per seed, the worst of each figure kept
          top = max((r for r in report.rows if r.tolerance != NOT_HELD),
                    key=lambda r: r.measured / r.tolerance)
          logger.info(f'seed {seed}, modern ({engine}): ' + (report.parting or (
              'PASS' if report.passed else 'FAIL (the identity)')) + f'; worst: {top.check} '
                      f'{top.name} {top.measured:.2e} (tolerance {top.tolerance:.0e})')
          report = dataclasses.replace(report, parting=None, rows=worst(
              (merged[engine].rows if engine in merged else [])
              + [r._replace(seed=seed) for r in report.rows]))
        merged[engine] = report
  return (merged, *batches, init)
