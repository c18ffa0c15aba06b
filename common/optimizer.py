"""The optimizer both trainers apply, and the names of its slots in a checkpoint.

`OptimizerSpec` (a spec, not an optimizer) is what the flags `--optimizer`, `--momentum`, `--adam_beta1/2`,
`--adam_epsilon`, `--learning_rate`, `--clip_norm` and `--clip_where` say;
legacy turns it into TF1's own optimizer (`tf.compat.v1.train.*Optimizer`,
`tf.clip_by_global_norm`), modern into the same kernels written out
(modern/step.py). The default is upstream's: plain SGD at 0.1, no clipping.

The slots are named as TF1's optimizers name them in a legacy checkpoint, and
modern keeps the same names under its `optimizer/` checkpoint node, so
`convert` maps them one to one:

  momentum  '<variable>/Momentum'                      (the accumulator)
  adam      '<variable>/Adam', '<variable>/Adam_1'     (m and v)
            'beta1_power', 'beta2_power'               (beta ** step, scalars)

where <variable> is one of `model_spec.VARIABLE_NAMES`.
"""

import dataclasses

from cifar10_towers.common import hparams

SGD, MOMENTUM, ADAM = 'sgd', 'momentum', 'adam'
NAMES = (SGD, MOMENTUM, ADAM)  # values of --optimizer
AVERAGED, PER_TOWER = 'averaged', 'per_tower'
CLIP_WHERE = (AVERAGED, PER_TOWER)  # values of --clip_where

# Slot suffixes per optimizer, as TF1's optimizers name them.
SLOT_SUFFIXES = {SGD: (), MOMENTUM: ('Momentum',), ADAM: ('Adam', 'Adam_1')}
# Scalars an optimizer keeps besides its slots (TF1's "non-slot" variables).
NON_SLOT_NAMES = {SGD: (), MOMENTUM: (), ADAM: ('beta1_power', 'beta2_power')}


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
  """The update rule of a run; the same fields mean the same in both trainers."""
  name: str = SGD  # sgd, momentum or adam
  learning_rate: float = hparams.INITIAL_LEARNING_RATE  # decayed by upstream's staircase
  momentum: float = 0.9  # momentum: accum = momentum * accum + grad
  adam_beta1: float = 0.9  # TF1 AdamOptimizer's defaults
  adam_beta2: float = 0.999
  adam_epsilon: float = 1e-8
  clip_norm: float | None = None  # None = no clipping
  clip_where: str = AVERAGED  # averaged: the towers' mean; per_tower: each tower's own

  @property
  def clips_averaged(self):
    return self.clip_norm is not None and self.clip_where == AVERAGED

  @property
  def clips_per_tower(self):
    return self.clip_norm is not None and self.clip_where == PER_TOWER

  def slot_names(self):
    """Legacy names of every slot and non-slot variable, in a fixed order."""
    return slot_names(self.name)

  def initial_value(self, slot_name):
    """A slot's value at a fresh start, as TF1's optimizers create it: beta1_power and
    beta2_power at beta (its power at step 1), every other slot 0 (each element)."""
    return {'beta1_power': self.adam_beta1, 'beta2_power': self.adam_beta2}.get(slot_name, 0.0)


def slot_names(name):
  """Legacy names of the slots and non-slot variables of optimizer `name`."""
  # Imported here: model_spec imports TensorFlow, not wanted for --help.
  from cifar10_towers.common import model_spec  # pylint: disable=g-import-not-at-top
  return tuple(f'{var}/{suffix}' for var in model_spec.VARIABLE_NAMES
               for suffix in SLOT_SUFFIXES[name]) + NON_SLOT_NAMES[name]


def slot_shape(slot_name):
  """Shape of a slot named like 'conv1/weights/Adam' (scalars: ())."""
  from cifar10_towers.common import model_spec  # pylint: disable=g-import-not-at-top
  return model_spec.variable_shape(slot_name.rsplit('/', 1)[0]) if '/' in slot_name else ()


def of_names(names, key=lambda name: name):
  """Which optimizer wrote a checkpoint, from the names it holds.

  Args:
    names: a collection (dict, set, list) of a checkpoint's keys.
    key: callable mapping a legacy name to the checkpoint's key for it
      (identity for legacy; modern.checkpoints.checkpoint_key for modern).

  Returns:
    'sgd', 'momentum' or 'adam': the optimizer whose first slot is there
    (a checkpoint without any slot is plain SGD's, as before this existed).
  """
  return next((name for name in (ADAM, MOMENTUM) if key(slot_names(name)[0]) in names), SGD)


def mismatch(path, saved, wanted):
  """The one-line refusal of a checkpoint whose optimizer differs from the run's.

  Silently dropping the saved slots (resuming Adam as SGD) or starting them
  at zero (resuming SGD as Adam) would change the training without saying so.

  Returns:
    str, or None when they agree.
  """
  if saved == wanted:
    return None
  change = 'drop' if wanted == SGD else ('zero-fill' if saved == SGD else 'drop and zero-fill')
  return (f'{path} was trained with --optimizer {saved}; this run has --optimizer {wanted}, '
          f'which would {change} its optimizer state. Resume it with --optimizer {saved}, '
          'or train in another --train_dir.')
