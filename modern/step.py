"""One training step in TF2: tf.function towers, averaged gradients, SGD, moving averages.

The step of upstream `cifar10_multi_gpu_train.py` (docs/equivalence.md §1)
without `tf.compat.v1`: the variables live on `devices.VARIABLE_DEVICE`; each
step reads them once there, sends the values to N towers (one per device of
the `DevicePlan`), each tower computes its own batch's loss and gradients, the
gradients meet on the variables' device to be averaged, and plain gradient
descent, the global step and the moving averages are updated there.

No Keras optimizer: `tf.keras.optimizers.SGD` under a distribution strategy
sums gradients across replicas implicitly, which changes the arithmetic the
equivalence contract (docs/equivalence.md §2) compares. The update is written
out instead (`TrainState.apply_gradients`), once for every engine.
"""

import tensorflow as tf

from common import devices
from common import hparams
from common import lrn
from common import model_spec
from modern import model as model_lib

TOWER_NAME = hparams.TOWER_NAME


def tower_loss(model, images, labels, params=None):
  """Total loss of one tower on its own batch (upstream `tower_loss`).

  Args:
    model: Cifar10Model.
    images: float32 [batch, 24, 24, 3].
    labels: int32 [batch].
    params: optional `model.params(values)`; default the model's variables.

  Returns:
    float32 scalar: the batch's mean cross-entropy + each weight-decay term
    once. (Upstream filtered the 'losses' collection by the tower's name scope
    for the same reason: weight decay counted once per tower.)
  """
  logits = model.inference(images, params)
  return model.loss(logits, labels, params)


def average_gradients(tower_grads):
  """Per variable, the mean of the towers' gradients (upstream `average_gradients`).

  Args:
    tower_grads: list over towers of lists of (gradient, variable), every
      tower listing the same variables in the same order.

  Returns:
    list of (averaged gradient, variable), in that order.
  """
  average_grads = []
  for grad_and_vars in zip(*tower_grads):
    # grad_and_vars: ((grad_tower0, var), ..., (grad_towerN-1, var)).
    grads = tf.stack([g for g, _ in grad_and_vars], axis=0)  # [N, *var.shape]
    average_grads.append((tf.reduce_mean(grads, axis=0), grad_and_vars[0][1]))
  return average_grads


def _assign(var, fn, args=()):
  return fn(var, *args)


class TrainState:
  """What a step changes: the model, the global step and the moving averages.

  Created under a tf.distribute strategy's scope, the variables are mirrored
  (one copy per replica); `apply_gradients` then takes the strategy's
  `extended.update` to update every copy.

  Attributes:
    model: Cifar10Model.
    global_step: int64 tf.Variable on VARIABLE_DEVICE.
    ema: modern.model.MovingAverages.
    decay_steps: int, steps between learning-rate decays.
  """

  def __init__(self, plan, decay_steps):
    """Creates the variables (initial values from the tf.random global seed).

    Args:
      plan: common.devices.DevicePlan the towers run on.
      decay_steps: int >= 1, `hparams.decay_steps(...)`.
    """
    if decay_steps < 1:
      raise ValueError('decay_steps must be >= 1, got %d' % decay_steps)
    self.decay_steps = int(decay_steps)
    # Deviation from upstream: CPU towers compute the LRN with common.lrn's XLA functions.
    # The same function as tf.nn.lrn to ~4e-7 relative (tests/test_lrn.py).
    self.model = model_lib.Cifar10Model(lrn=lrn.for_plan(plan))
    with tf.device(devices.VARIABLE_DEVICE):
      self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                     name='global_step')
    self.ema = model_lib.MovingAverages(self.model)

  def apply_gradients(self, grads, update=_assign):
    """Plain SGD with upstream's decayed rate, the step's increment, the averages.

    Args:
      grads: list of averaged gradients in VARIABLE_NAMES order.
      update: callable(var, fn, args=()) running fn(copy, *args) on every copy
        of `var` (a strategy's `extended.update`); default: the one copy.
    """
    with tf.name_scope('update'):
      # Read before the increment, as exponential_decay inside legacy's
      # apply_gradients reads it.
      lr = model_spec.learning_rate(self.global_step, self.decay_steps)
      for grad, var in zip(grads, self.model.variable_list()):
        update(var, lambda v, g: v.assign_sub(lr * g), args=(grad,))
      self.global_step.assign_add(1)
    with tf.name_scope('moving_average'):
      # Deviation from upstream: the moving averages see the updated variables and the new step.
      # Legacy applies the moving averages under control_dependencies on
      # apply_gradients, so they see the new weights and the incremented
      # step. tf.function keeps program order for ops on the same variable.
      one_minus_decay = 1.0 - model_spec.ema_decay(self.global_step)
      for shadow, var in zip(self.ema.variables_by_name().values(),
                             self.model.variable_list()):
        # The operand order of legacy's assign_moving_average.
        update(shadow, lambda s, v: s.assign_sub((s - v) * one_minus_decay),
               args=(var,))

  # --- state access (for the cross-check harness, convert and tests) --------

  def variables(self):
    """Dict 'conv1/weights' -> trainable tf.Variable, in VARIABLE_NAMES order."""
    return self.model.variables_by_name()

  def shadow_variables(self):
    """Dict 'conv1/weights' -> moving-average tf.Variable, in VARIABLE_NAMES order."""
    return self.ema.variables_by_name()

  def assign_variables(self, values, shadow_values=None):
    """Sets the trainable variables and their moving averages.

    Args:
      values: dict 'conv1/weights' -> array of that variable's shape, for all
        10 variables.
      shadow_values: optional dict like `values` for the shadows; by default
        each shadow is set to its variable's new value, as at a fresh start.

    Raises:
      ValueError: a name is missing or unknown, or a shape is wrong.
    """
    shadow_values = values if shadow_values is None else shadow_values
    for what, given, targets in (('values', values, self.variables()),
                                 ('shadow_values', shadow_values,
                                  self.shadow_variables())):
      missing = sorted(set(targets) - set(given))
      unknown = sorted(set(given) - set(targets))
      if missing or unknown:
        raise ValueError('%s: missing %s, unknown %s' % (what, missing, unknown))
      for name, var in targets.items():
        if tuple(tf.shape(given[name]).numpy()) != tuple(var.shape):
          raise ValueError('%s[%r] has shape %s, the variable %s'
                           % (what, name, tuple(tf.shape(given[name]).numpy()),
                              tuple(var.shape)))
    for name, var in self.variables().items():
      var.assign(tf.cast(values[name], tf.float32))
    for name, var in self.shadow_variables().items():
      var.assign(tf.cast(shadow_values[name], tf.float32))


def check_batches(tower_batches, counts, leading, note=''):
  """(images float32, labels int32) of a step, checked for shape.

  Args:
    tower_batches: (images [N, batch, 24, 24, 3], labels [N, batch]).
    counts: the values N may take.
    leading, note: how an error names N.
  """
  images, labels = tower_batches
  images = tf.convert_to_tensor(images, tf.float32)
  labels = tf.convert_to_tensor(labels, tf.int32)
  size = hparams.IMAGE_SIZE
  if (images.shape.rank != 5 or images.shape[0] not in counts
      or tuple(images.shape[2:]) != (size, size, 3)):
    raise ValueError('images must be [%s, batch, %d, %d, 3]%s, got %s'
                     % (leading, size, size, note, images.shape))
  if tuple(labels.shape) != tuple(images.shape[:2]):
    raise ValueError('labels must be %s, got %s'
                     % (tuple(images.shape[:2]), labels.shape))
  return images, labels


class Trainer:
  """The tower step: one tf.function tower per device of the plan.

  Attributes:
    plan: common.devices.DevicePlan, tower i runs on plan.tower_devices[i].
    num_towers: int.
    state: TrainState.
  """

  def __init__(self, plan, decay_steps, jit=False):
    """Creates the state (see TrainState) and the step's functions.

    Args:
      plan: common.devices.DevicePlan.
      decay_steps: int >= 1, `hparams.decay_steps(...)`.
      jit: bool, compile each tower's forward and backward pass with XLA.
    """
    self.plan = plan
    self.num_towers = plan.num_towers
    self.state = TrainState(plan, decay_steps)
    # Not a whole-step jit_compile: XLA compiles one device's ops
    # and cannot read variables that live on another device, so with `jit`
    # each tower's loss-and-gradients function (which receives the variables'
    # values as arguments) is compiled for its own device.
    self._tower_fn = (tf.function(self._tower_loss_and_grads, jit_compile=True)
                      if jit else self._tower_loss_and_grads)
    self._train_step_fn = tf.function(self._train_step)
    self._compute_gradients_fn = tf.function(self._averaged_gradients)

  def _tower_loss_and_grads(self, values, images, labels):
    """One tower: its loss and the gradients w.r.t. the variables' values.

    Args:
      values: list of tensors, the variables' values in VARIABLE_NAMES order.
      images: float32 [batch, 24, 24, 3].
      labels: int32 [batch].

    Returns:
      (loss float32 scalar, list of gradients shaped like `values`).
    """
    model = self.state.model
    with tf.GradientTape() as tape:
      tape.watch(values)
      loss = tower_loss(model, images, labels, model.params(values))
    return loss, tape.gradient(loss, values)

  def _averaged_gradients(self, images, labels):
    """Runs the towers and averages their gradients, without applying them.

    Args:
      images: float32 [num_towers, batch, 24, 24, 3].
      labels: int32 [num_towers, batch].

    Returns:
      (list of averaged gradients in VARIABLE_NAMES order,
       tower total losses float32 [num_towers]).
    """
    variables = self.state.model.variable_list()
    with tf.device(devices.VARIABLE_DEVICE):
      # Each tower gets its own batch of the one pipeline (legacy: each tower
      # dequeues its own batch from the shared prefetch queue).
      tower_images = tf.unstack(images, num=self.num_towers, axis=0)
      tower_labels = tf.unstack(labels, num=self.num_towers, axis=0)
      # The variables are read once on their device; each tower receives a
      # copy of the values (legacy: towers read the CPU variables).
      values = [var.read_value() for var in variables]
    tower_grads, tower_losses = [], []
    for i, device in enumerate(self.plan.tower_devices):
      with tf.device(device), tf.name_scope('%s_%d' % (TOWER_NAME, i)):
        loss, grads = self._tower_fn(values, tower_images[i], tower_labels[i])
      tower_losses.append(loss)
      tower_grads.append(list(zip(grads, variables)))
    with tf.device(devices.VARIABLE_DEVICE), tf.name_scope('average_gradients'):
      # Synchronization point: the towers meet here. Each tower's loss is its
      # own batch's mean cross-entropy plus one weight-decay term, exactly as
      # legacy's tower_loss; gradients are linear, so the per-variable mean
      # over towers of these per-tower gradients is what legacy's
      # average_gradients computes (the same reduce_mean over the stacked
      # tower gradients), and - with equal batch sizes - the gradient of the
      # mean loss over all N*batch images with weight decay counted once.
      # Nothing is summed across replicas implicitly.
      grads = [g for g, _ in average_gradients(tower_grads)]
      return grads, tf.stack(tower_losses)

  def _train_step(self, images, labels):
    """One SGD step over all towers; returns tower losses float32 [num_towers]."""
    grads, tower_losses = self._averaged_gradients(images, labels)
    with tf.device(devices.VARIABLE_DEVICE):
      self.state.apply_gradients(grads)
    return tower_losses

  def _check(self, tower_batches):
    return check_batches(tower_batches, (self.num_towers,),
                         '%d towers' % self.num_towers)

  def train_step(self, tower_batches):
    """Runs one training step.

    Args:
      tower_batches: (images float32 [num_towers, batch, 24, 24, 3],
        labels int32 [num_towers, batch]), e.g. an element of
        `inputs.distorted_inputs`; tower i trains on images[i], labels[i].

    Returns:
      float32 tensor [num_towers], each tower's total loss (before the update).
    """
    return self._train_step_fn(*self._check(tower_batches))

  def compute_gradients(self, tower_batches):
    """The averaged gradients at the current variables, without applying them.

    Args:
      tower_batches: as for `train_step`.

    Returns:
      (dict variable name -> averaged gradient tensor, in VARIABLE_NAMES
       order; tower total losses float32 [num_towers]).
    """
    grads, tower_losses = self._compute_gradients_fn(*self._check(tower_batches))
    return dict(zip(model_spec.VARIABLE_NAMES, grads)), tower_losses
