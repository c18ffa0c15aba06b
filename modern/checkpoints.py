"""Modern checkpoints: their layout, restoring the latest, saving once per step.

Checkpoint layout (`checkpoint_object`, `tf.train.Checkpoint` keys as listed
by `tf.train.list_variables`), with the legacy `Saver` name each corresponds to:

  global_step/.ATTRIBUTES/VARIABLE_VALUE           global_step (int64 scalar)
  model/<layer>/<kind>/.ATTRIBUTES/VARIABLE_VALUE  <layer>/<kind>
  ema/<layer>/<kind>/.ATTRIBUTES/VARIABLE_VALUE    <layer>/<kind>/ExponentialMovingAverage
  optimizer/<slot>/.ATTRIBUTES/VARIABLE_VALUE      <slot> (momentum and Adam only)
  save_counter/.ATTRIBUTES/VARIABLE_VALUE          (tf.train.Checkpoint's own; none)
  _CHECKPOINTABLE_OBJECT_GRAPH                     (the object graph; none)

where <layer>/<kind> is one of `model_spec.VARIABLE_NAMES` ('conv1/weights',
..., 'softmax_linear/biases') and <slot> one of the optimizer's slot names
(`common.optimizer`: '<layer>/<kind>/Momentum', '<layer>/<kind>/Adam',
'<layer>/<kind>/Adam_1', 'beta1_power', 'beta2_power'); a plain SGD
checkpoint has no `optimizer/` node. `checkpoint_key(legacy_name)` computes the
left column. Files are `<train_dir>/model.ckpt-<global_step>.{index,data-*}`
plus the `checkpoint` state file, as with legacy's Saver.

Converting: modern -> legacy names is `tf.train.load_variable(path,
checkpoint_key(name))` for each legacy name; legacy -> modern is a
`modern.step.TrainState` whose variables, averages, slots and global step
(`convert.modern_variables`) are assigned the legacy values, saved through
`checkpoint_object(state)`.
"""

import functools

import tensorflow as tf

from cifar10_towers.common import model_spec
from cifar10_towers.common import optimizer as optimizer_lib
from cifar10_towers.runtime import checkpoints
from cifar10_towers.runtime import config as config_lib
from cifar10_towers.runtime import training

MAX_TO_KEEP = 5  # checkpoints kept in train_dir, like the Saver's default


def step_saver(checkpoint, directory):
  """The runtime.checkpoints.StepSaver of a `checkpoint_object` in `directory`.

  Create it after `restore_latest` (see there): its CheckpointManager reads
  the directory's `checkpoint` state file.
  """
  manager = tf.train.CheckpointManager(checkpoint, directory, max_to_keep=MAX_TO_KEEP,
                                       checkpoint_name=config_lib.CHECKPOINT_BASENAME)
  return checkpoints.StepSaver(directory, lambda: int(checkpoint.global_step.numpy()),
                               lambda step: manager.save(checkpoint_number=step))


def checkpoint_object(state):
  """The `tf.train.Checkpoint` of a modern.step.TrainState; keys as in the module docstring.

  The optimizer's slots go in as nested dicts, so that a checkpoint keys them
  'optimizer/conv1/weights/Adam/...': legacy's names under 'optimizer/'.
  """
  objects = dict(global_step=state.global_step, model=state.model, ema=state.ema)
  for name, variable in state.slots.items():  # none for SGD: no 'optimizer/'
    *parts, leaf = name.split('/')
    functools.reduce(lambda node, part: node.setdefault(part, {}), parts,
                     objects.setdefault('optimizer', {}))[leaf] = variable
  return tf.train.Checkpoint(**objects)


def restore_latest(train_dir, checkpoint, optimizer):
  """Restores `checkpoint` from what `runtime.checkpoints.resume` hands back, if anything.

  Args:
    train_dir: str.
    checkpoint: `checkpoint_object(trainer)`.
    optimizer: common.optimizer.OptimizerSpec of the run; a checkpoint of
      another optimizer is refused.

  An unreadable `checkpoint` state file (empty, not text), which
  resume_point passed over, is rewritten to name the restored checkpoint
  (removed when there is none): the CheckpointManager reads it before its
  first save, which would rewrite it anyway. So call this before creating
  the manager.

  Returns:
    The restored checkpoint's path, or None when train_dir has none.

  Raises:
    runtime.training.TrainingError, runtime.checkpoints.CheckpointError: see
      `checkpoints.resume`; or it does not fit the model.
  """
  contents = checkpoints.resume(train_dir, checkpoints.MODERN, optimizer.name,
                                legacy_shapes(optimizer.name), training.TrainingError,
                                checkpoint_key)
  resume_from = contents and contents.path
  if resume_from:
    try:
      checkpoint.restore(resume_from).assert_existing_objects_matched()
    except (AssertionError, ValueError, tf.errors.OpError) as e:
      raise training.TrainingError(
          f'{resume_from} does not fit this model ({checkpoints.reason(e)}). Use another '
          '--train_dir, or move its checkpoints away.') from e
  checkpoints.replace_unreadable_state(train_dir, resume_from)
  return resume_from


def _keys(optimizers):
  """Legacy name -> modern key (less its '/.ATTRIBUTES/VARIABLE_VALUE') of everything the
  training checkpoints of `optimizers` (names) hold: the left columns of the module docstring."""
  keys = {'global_step': 'global_step'}
  for name in model_spec.VARIABLE_NAMES:
    keys[name], keys[model_spec.average_name(name)] = f'model/{name}', f'ema/{name}'
  keys.update((slot, f'optimizer/{slot}') for o in optimizers
              for slot in optimizer_lib.slot_names(o))
  return keys


def legacy_shapes(optimizer):
  """Legacy name -> shape of everything a training checkpoint of `optimizer` holds."""
  # A moving average or a slot has its variable's shape (optimizer_lib.slot_shape).
  return {name: model_spec.variable_shape(name) if name in model_spec.VARIABLE_NAMES
          else optimizer_lib.slot_shape(name) for name in _keys([optimizer])}


def checkpoint_key(legacy_name):
  """The modern checkpoint key holding what legacy's Saver names `legacy_name`.

  Args:
    legacy_name: 'global_step', 'conv1/weights' (any of VARIABLE_NAMES),
      'conv1/weights/ExponentialMovingAverage', or an optimizer slot
      ('conv1/weights/Momentum', '.../Adam', '.../Adam_1', 'beta1_power',
      'beta2_power').

  Returns:
    str, e.g. 'ema/conv1/weights/.ATTRIBUTES/VARIABLE_VALUE'.

  Raises:
    KeyError: the name is none of these.
  """
  return f'{_keys(optimizer_lib.NAMES)[legacy_name]}/.ATTRIBUTES/VARIABLE_VALUE'
