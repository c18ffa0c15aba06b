"""Moving a train_dir between the trainers: legacy Saver <-> modern tf.train.Checkpoint.

What moves: the 10 weights, their 10 moving averages, the global step and
every slot of the optimizer (momentum's accumulators; Adam's m, v, beta1_power
and beta2_power; plain SGD has none), bit for bit. Legacy names the slots as
TF1's optimizers do ('conv1/weights/Adam'), modern keeps the same names under
'optimizer/' (modern/checkpoints.py). Each side's checkpoint is written by that
side's own code (legacy's graph and `Saver`, modern's `TrainState` and
`CheckpointManager`), so the result is
what that trainer would have saved itself, and it resumes or evaluates it
without knowing it was converted.
"""

import contextlib
import errno
import logging
import os

import tensorflow as tf
import tensorflow.compat.v1 as tf1

from cifar10_towers.common import devices
from cifar10_towers.common import errors
from cifar10_towers.common import files
from cifar10_towers.common import hparams
from cifar10_towers.common import model_spec
from cifar10_towers.common import optimizer as optimizer_lib
from cifar10_towers.common import prog
from cifar10_towers.modern import checkpoints as modern_checkpoints
from cifar10_towers.runtime import checkpoints
from cifar10_towers.runtime import config as config_lib

logger = logging.getLogger(__name__)


class ConvertError(errors.Failure):
  """A conversion cannot be done; the message says why and what to do."""


# What to do about a --from_dir whose checkpoint cannot be converted.
_PASS_A_TRAIN_DIR = ('nothing was converted. Pass as --from_dir a train_dir that '
                     'the legacy or the modern trainer (or upstream\'s) trained.')


# One tower on the variables' device: conversion builds, never trains.
_HOST_PLAN = devices.DevicePlan((devices.VARIABLE_DEVICE,), 'cpu', 1)


def state_of(contents):
  """The weights, moving averages, global step and slots of a checkpoint read whole.

  Args:
    contents: runtime.checkpoints.Contents.

  Returns:
    (kind, optimizer, values): kind is checkpoints.LEGACY or MODERN;
    optimizer is the name of the optimizer that wrote it ('sgd', 'momentum',
    'adam', by the slots it holds); values maps the legacy name of every
    variable a training checkpoint of that optimizer holds
    (modern.checkpoints.legacy_shapes: 'conv1/weights',
    'conv1/weights/ExponentialMovingAverage', its slots, 'global_step') to a
    numpy array, the global step to an int (upstream's float32 global step as
    the int it counts).

  Raises:
    ConvertError: it lacks a variable of this model (or of its optimizer,
      or the global step), or has a wrong shape.
  """
  path, kind, tensors = contents
  key_of = modern_checkpoints.checkpoint_key if kind == checkpoints.MODERN else str
  optimizer = optimizer_lib.of_names(tensors, key_of)
  shapes = modern_checkpoints.legacy_shapes(optimizer)
  if problem := checkpoints.misfit(contents, shapes, key_of):
    incomplete = ', or an incomplete one' if problem[0].startswith('it lacks') else ''
    raise ConvertError(f'{path} is a checkpoint of another model{incomplete}: {problem[0]}; '
                       f'{_PASS_A_TRAIN_DIR}')
  values = {name: tensors[key_of(name)] for name in shapes}
  values['global_step'] = checkpoints.global_step(contents)
  return kind, optimizer, values


def write_modern(directory, values, optimizer):
  """Saves the state as the modern trainer does; returns the checkpoint prefix.

  `values` is a state as `state_of` returns it, of the optimizer named
  `optimizer`.
  """
  from cifar10_towers.modern import step as modern_step  # pylint: disable=g-import-not-at-top
  state = modern_step.TrainState(_HOST_PLAN, decay_steps=1,
                                 optimizer=optimizer_lib.OptimizerSpec(name=optimizer))
  for name, var in modern_variables(state).items():
    var.assign(values[name])
  # The trainer's own CheckpointManager write (its errors raised as they are).
  return modern_checkpoints.step_saver(modern_checkpoints.checkpoint_object(state),
                                       directory).write(values['global_step'])


def modern_variables(state):
  """Every tf.Variable of a modern TrainState by its legacy name (as `state_of`'s values)."""
  return {**state.variables(), **state.slots, 'global_step': state.global_step,
          **{model_spec.average_name(n): v for n, v in state.shadow_variables().items()}}


def write_legacy(directory, values, optimizer):
  """Saves the state as the legacy trainer does; returns the checkpoint prefix.

  `values` is a state as `state_of` returns it, of the optimizer named
  `optimizer`: the graph holds TF1's own optimizer, so the slots are the
  variables it makes.

  The graph is legacy's own (`legacy_session`, never run), so the Saver sees
  exactly the variables a legacy train_dir holds.
  """
  with legacy_session([1, 1], _HOST_PLAN, 1, optimizer_lib.OptimizerSpec(name=optimizer),
                      values) as (sess, *_), sess.graph.as_default():
    return tf1.train.Saver(tf1.global_variables(), save_relative_paths=True).save(
        sess, os.path.join(directory, config_lib.CHECKPOINT_BASENAME),
        global_step=values['global_step'])


@contextlib.contextmanager
def legacy_session(batch_shape, plan, decay_steps, optimizer, values):
  """A Session on legacy's own graph with the variables set as given.

  The graph is legacy's `build_towers`, its tower batches fed instead of the
  prefetch queue: tower i's batch is `inputs`' images[i] and labels[i]
  (placeholders [N, B, 24, 24, 3] float32 and [N, B] int32, batch_shape
  [N, B]). Each variable `values` names by its legacy name ('conv1/weights',
  'conv1/weights/ExponentialMovingAverage', an optimizer slot,
  'global_step') is set to its value there; the rest keep their initial
  values. The graph is not made the default (eager code may run meanwhile).

  Yields:
    (tf.compat.v1.Session, legacy.train.TowerOps, dict name -> tf.Variable of
     every global variable, inputs).
  """
  from cifar10_towers.legacy import train as legacy_train  # pylint: disable=g-import-not-at-top
  graph = tf.Graph()
  with graph.as_default():
    inputs = (tf1.placeholder(tf.float32, batch_shape + [hparams.IMAGE_SIZE] * 2 + [3]),
              tf1.placeholder(tf.int32, batch_shape))
    towers = legacy_train.build_towers(list(zip(*map(tf.unstack, inputs))), plan, decay_steps,
                                       optimizer=optimizer)
    variables = {v.op.name: v for v in tf1.global_variables()}
    init = tf1.global_variables_initializer()
  with contextlib.closing(tf1.Session(graph=graph,
                                      config=legacy_train.session_config(plan))) as sess:
    sess.run(init)
    set_values(sess, variables, values)
    yield sess, towers, variables, inputs


def set_values(sess, variables, values):
  """Sets each tf.Variable of `variables` that `values` names (legacy names) to its array."""
  # All in one run, as Variable.load does each (a run per variable cost 0.4 s).
  sess.run([variables[name].initializer for name in values],
           {variables[name].initializer.inputs[1]: value for name, value in values.items()})


def convert(from_dir, to_dir):
  """Converts the newest checkpoint of `from_dir` into the other trainer's format.

  The newest checkpoint must be intact and the `checkpoint` state file
  readable (`runtime.checkpoints.for_conversion`): a damaged one is refused,
  not passed over. `to_dir` must not hold a checkpoint yet; it is written in
  a temporary directory beside it first, so a failure leaves nothing
  half-written. Nothing in `from_dir` is changed: `to_dir` must be neither
  `from_dir` nor inside it, however either is spelled. A killed convert's
  temporary directory (`common.files.scratch`) is removed by the next one
  beside the same `to_dir`. Then it says (logger.info)
  what it wrote, and the command that trains on from it.

  Args:
    from_dir: str, a train_dir of either trainer (or upstream's).
    to_dir: str, a new or empty directory.

  Returns:
    (from_kind, to_kind, step, new checkpoint prefix).

  Raises:
    ConvertError, runtime.checkpoints.CheckpointError: as the message says.
  """
  # A trailing slash, a relative path or a symlink can name one directory
  # twice: the real paths are compared, and the message names both as given
  # and the directory they reach.
  source, real_to_dir = os.path.realpath(from_dir), os.path.realpath(to_dir)
  if os.path.commonpath([source, real_to_dir]) == source:
    raise ConvertError(f'--to_dir {to_dir} is {real_to_dir}, --from_dir {from_dir} or inside it: '
                       'the converted checkpoint goes to a directory of its own. Pass a new or '
                       f'empty directory outside it as --to_dir, e.g. {source}_converted; nothing '
                       'was converted.')
  contents = checkpoints.for_conversion(from_dir)
  if contents is None:
    raise ConvertError(f'no checkpoint in {from_dir}; pass as --from_dir the train_dir you '
                       'trained into.')
  not_empty = ConvertError(f'{to_dir} is not empty; pass a new or empty directory as '
                           '--to_dir (nothing there was changed).')
  if os.path.isdir(to_dir) and os.listdir(to_dir):
    raise not_empty
  kind, optimizer, values = state_of(contents)
  to_kind, writer = ((checkpoints.MODERN, write_modern) if kind == checkpoints.LEGACY
                     else (checkpoints.LEGACY, write_legacy))
  target = os.path.abspath(to_dir)
  parent, name = os.path.split(target)
  try:
    os.makedirs(parent, exist_ok=True)
    with files.scratch(parent, f'.{name}.converting-') as staging:
      prefix = writer(staging, values, optimizer)
      os.rename(staging, target)  # POSIX: also onto an empty directory (checked above)
  except OSError as e:  # said without the staging directory's name
    if e.errno in (errno.ENOTEMPTY, errno.EEXIST):  # another command wrote there meanwhile
      raise not_empty from e
    raise ConvertError(
        files.write_failed('the converted checkpoint', to_dir, e.strerror, '--to_dir')) from e
  except tf.errors.OpError as e:  # TensorFlow's writer: a full disk, say
    raise checkpoints.write_failed(to_dir, 'the converted checkpoint', e, '--to_dir') from e
  path = os.path.join(target, os.path.basename(prefix))
  # A resume with another --optimizer is refused: say which one it needs.
  step = values['global_step']
  again = '' if optimizer == optimizer_lib.SGD else f' --optimizer {optimizer}'
  command = prog.command(to_kind, train_dir=to_dir) + again
  logger.info(f'Converted the {kind} checkpoint of {from_dir} at global step {step} to a '
              f'{to_kind} checkpoint (optimizer {optimizer}, its slots included): {path}\n'
              f'Continue with `{command}`.')
  return kind, to_kind, step, path
