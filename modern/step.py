"""One training step in TF2: tf.function towers, averaged gradients, the update, moving averages.

The step of upstream `cifar10_multi_gpu_train.py` (docs/equivalence.md §1)
without `tf.compat.v1`: the variables live on `devices.VARIABLE_DEVICE`; each
step reads them once there, sends the values to N towers (one per device of
the `DevicePlan`), each tower computes its own batch's loss and gradients, the
gradients meet on the variables' device to be averaged, and the update (plain
gradient descent, or momentum or Adam: common.optimizer), the global step and
the moving averages are updated there.

No Keras optimizer: `tf.keras.optimizers.SGD` under a distribution strategy
sums gradients across replicas implicitly, which changes the arithmetic the
equivalence contract (docs/equivalence.md §2) compares. The update is written
out instead (`TrainState.apply_gradients`), once for every engine, with the
kernels TF1's MomentumOptimizer and AdamOptimizer run in legacy
(`ResourceApplyMomentum`, `ResourceApplyAdam`), so both trainers do the same
arithmetic.
"""

import tensorflow as tf

from cifar10_towers.common import devices
from cifar10_towers.common import hparams
from cifar10_towers.common import lrn
from cifar10_towers.common import model_spec
from cifar10_towers.common import optimizer as optimizer_lib
from cifar10_towers.common import training
from cifar10_towers.modern import model as model_lib

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


def clip(grads, clip_norm):
  """`tf.clip_by_global_norm` of a list of gradients (what legacy's graph runs)."""
  with tf.name_scope('clip_gradients'):
    return tf.clip_by_global_norm(grads, clip_norm)[0]


# The updates of TF1's optimizers, kernel for kernel (their _resource_apply_dense
# and _finish), so that legacy and modern agree to the last bit but for the
# gradients' own rounding. Module functions so that a test can break one.

def apply_sgd(var, grad, lr):
  """var -= lr * grad."""
  return var.assign_sub(lr * grad)


def apply_momentum(var, accum, grad, lr, momentum):
  """accum = momentum * accum + grad; var -= lr * accum (MomentumOptimizer)."""
  return tf.raw_ops.ResourceApplyMomentum(
      var=var.handle, accum=accum.handle, lr=lr, grad=grad, momentum=momentum,
      use_locking=False, use_nesterov=False)


def apply_adam(var, m, v, beta1_power, beta2_power, grad, lr, beta1, beta2,
               epsilon):
  """AdamOptimizer's step: m, v updated, var -= lr_t * m / (sqrt(v) + epsilon).

  lr_t = lr * sqrt(1 - beta2_power) / (1 - beta1_power), the bias correction,
  with beta*_power = beta* ** step (the step counted from 1).
  """
  return tf.raw_ops.ResourceApplyAdam(
      var=var.handle, m=m.handle, v=v.handle,
      beta1_power=beta1_power.read_value(), beta2_power=beta2_power.read_value(),
      lr=lr, beta1=beta1, beta2=beta2, epsilon=epsilon, grad=grad,
      use_locking=False, use_nesterov=False)


class OptimizerSlots(tf.Module):
  """The optimizer's slots as a tree of modules, so that a checkpoint keys them
  'optimizer/conv1/weights/Adam/...': legacy's names under 'optimizer/'."""

  def __init__(self):
    super().__init__(name='optimizer')

  def add(self, legacy_name, variable):
    node = self
    parts = legacy_name.split('/')
    for part in parts[:-1]:
      child = node.__dict__.get(part)
      if child is None:
        child = tf.Module(name=part)
        setattr(node, part, child)
      node = child
    setattr(node, parts[-1], variable)


class TrainState:
  """What a step changes: the model, the optimizer's slots, the global step
  and the moving averages.

  Created under a tf.distribute strategy's scope, the variables are mirrored
  (one copy per replica); `apply_gradients` then takes the strategy's
  `extended.update` to update every copy.

  Attributes:
    model: Cifar10Model.
    optimizer: common.optimizer.Optimizer.
    slots: OptimizerSlots, or None for SGD (no slots).
    global_step: int64 tf.Variable on VARIABLE_DEVICE.
    ema: modern.model.MovingAverages.
    decay_steps: int, steps between learning-rate decays.
  """

  def __init__(self, plan, decay_steps, optimizer=optimizer_lib.Optimizer()):
    """Creates the variables (initial values from the tf.random global seed).

    Args:
      plan: common.devices.DevicePlan the towers run on.
      decay_steps: int >= 1, `hparams.decay_steps(...)`.
      optimizer: common.optimizer.Optimizer; default upstream's SGD.
    """
    if decay_steps < 1:
      raise ValueError('decay_steps must be >= 1, got %d' % decay_steps)
    self.decay_steps = int(decay_steps)
    # Deviation from upstream: CPU towers compute the LRN with common.lrn's XLA functions.
    # The same function as tf.nn.lrn to ~4e-7 relative (tests/test_lrn.py).
    self.lrn = lrn.for_plan(plan)
    self.model = model_lib.Cifar10Model(lrn=self.lrn)
    with tf.device(devices.VARIABLE_DEVICE):
      self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                     name='global_step')
    self.ema = model_lib.MovingAverages(self.model)
    self.optimizer = optimizer
    # As TF1's optimizers create them: slots zero, beta powers at beta (the
    # power of step 1).
    self._slots = {}
    initial = {'beta1_power': optimizer.adam_beta1,
               'beta2_power': optimizer.adam_beta2}
    with tf.device(devices.VARIABLE_DEVICE):
      for name in optimizer.slot_names():
        value = (initial[name] if name in initial
                 else tf.zeros(optimizer_lib.slot_shape(name), tf.float32))
        self._slots[name] = tf.Variable(value, dtype=tf.float32,
                                        trainable=False, name=name)
    self.slots = None
    if self._slots:
      self.slots = OptimizerSlots()
      for name, var in self._slots.items():
        self.slots.add(name, var)

  def clip_tower(self, grads, scale=1.0):
    """One tower's gradients, clipped by their global norm if --clip_where per_tower.

    Args:
      grads: list of one tower's gradients.
      scale: the factor the gradients carry (a replica's 1/R): the bound is
        scaled with them, so the result is scale x the clipped gradients.
    """
    if not self.optimizer.clips_per_tower:
      return grads
    return clip(grads, self.optimizer.clip_norm * scale)

  def clip_averaged(self, grads):
    """The averaged gradients, clipped by their global norm if --clip_where averaged."""
    if not self.optimizer.clips_averaged:
      return grads
    return clip(grads, self.optimizer.clip_norm)

  def apply_gradients(self, grads, update=_assign):
    """The optimizer's update at upstream's decayed rate, the step's increment, the averages.

    Args:
      grads: list of averaged gradients in VARIABLE_NAMES order, already
        clipped (`clip_averaged`).
      update: callable(var, fn, args=()) running fn(copy, *args) on every copy
        of `var` (a strategy's `extended.update`, which hands fn each
        replica's own copy of the variables in args too); default: the one copy.
    """
    spec = self.optimizer
    slots = self._slots
    with tf.name_scope('update'):
      # Read before the increment, as exponential_decay inside legacy's
      # apply_gradients reads it.
      lr = model_spec.learning_rate(self.global_step, self.decay_steps,
                                    spec.learning_rate)
      for name, grad, var in zip(model_spec.VARIABLE_NAMES, grads,
                                 self.model.variable_list()):
        if spec.name == optimizer_lib.MOMENTUM:
          momentum = tf.constant(spec.momentum, tf.float32)
          update(var, lambda v, a, g: apply_momentum(v, a, g, lr, momentum),
                 args=(slots[name + '/Momentum'], grad))
        elif spec.name == optimizer_lib.ADAM:
          constants = [tf.constant(x, tf.float32) for x in (
              spec.adam_beta1, spec.adam_beta2, spec.adam_epsilon)]
          update(var, lambda v, m, s, b1, b2, g: apply_adam(
              v, m, s, b1, b2, g, lr, *constants),
                 args=(slots[name + '/Adam'], slots[name + '/Adam_1'],
                       slots['beta1_power'], slots['beta2_power'], grad))
        else:
          update(var, lambda v, g: apply_sgd(v, g, lr), args=(grad,))
      if spec.name == optimizer_lib.ADAM:
        # After every variable's update, as AdamOptimizer._finish does
        # (tf.function orders these writes after the reads above).
        for power, beta in (('beta1_power', spec.adam_beta1),
                            ('beta2_power', spec.adam_beta2)):
          beta = tf.constant(beta, tf.float32)
          update(slots[power], lambda p, b: p.assign(p * b), args=(beta,))
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

  def slot_variables(self):
    """Dict legacy slot name ('conv1/weights/Adam', 'beta1_power', ...) -> tf.Variable."""
    return dict(self._slots)

  def assign_slots(self, values):
    """Sets every slot; `values` maps each name of `slot_variables()` to an array.

    Raises:
      ValueError: a name is missing or unknown, or a shape is wrong.
    """
    missing = sorted(set(self._slots) - set(values))
    unknown = sorted(set(values) - set(self._slots))
    if missing or unknown:
      raise ValueError('slots: missing %s, unknown %s' % (missing, unknown))
    for name, var in self._slots.items():
      if tuple(tf.shape(values[name]).numpy()) != tuple(var.shape):
        raise ValueError('slot %r has shape %s, the variable %s'
                         % (name, tuple(tf.shape(values[name]).numpy()),
                            tuple(var.shape)))
      var.assign(tf.cast(values[name], tf.float32))

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

  def __init__(self, plan, decay_steps, jit=False,
               optimizer=optimizer_lib.Optimizer()):
    """Creates the state (see TrainState) and the step's functions.

    Args:
      plan: common.devices.DevicePlan.
      decay_steps: int >= 1, `hparams.decay_steps(...)`.
      jit: bool, compile each tower's forward and backward pass with XLA.
      optimizer: common.optimizer.Optimizer; default upstream's SGD.
    """
    self.plan = plan
    self.num_towers = plan.num_towers
    self.state = TrainState(plan, decay_steps, optimizer)
    # Not a whole-step jit_compile: XLA compiles one device's ops
    # and cannot read variables that live on another device, so with `jit`
    # each tower's loss-and-gradients function (which receives the variables'
    # values as arguments) is compiled for its own device.
    self._tower_fn = (tf.function(self._tower_loss_and_grads, jit_compile=True)
                      if jit else self._tower_loss_and_grads)
    self._train_step_fn = tf.function(self._train_step)
    self._compute_gradients_fn = tf.function(self._averaged_gradients)
    # The step of the steps that write summaries: the same arithmetic, and
    # what the summaries need from inside it; traced at the first of them, so
    # the other steps run the plain step unchanged.
    self._summary_tower_fn = (
        tf.function(self._tower_summaries, jit_compile=True) if jit
        else self._tower_summaries)
    self._summary_step_fn = tf.function(self._train_step_with_summaries)

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

  def _tower_summaries(self, values, images, labels):
    """`_tower_loss_and_grads`, and the tower's loss terms and activations.

    The loss and gradients are those of `tower_loss` (the same forward pass,
    with a hook that only keeps each layer's output).

    Returns:
      (loss, gradients, loss terms in `training.loss_terms()` order,
       the layers' activations in model_spec.LAYERS order,
       their fractions of zeros).
    """
    model = self.state.model
    activations = []
    with tf.GradientTape() as tape:
      tape.watch(values)
      params = model.params(values)
      logits = model_spec.forward(images, params, activation_hook=activations.append,
                                  lrn=self.state.lrn)
      loss = model.loss(logits, labels, params)
    grads = tape.gradient(loss, values)
    terms = [model_spec.weight_decay(params[layer.name][0], layer.wd)
             for layer in model_spec.LAYERS if layer.wd is not None]
    terms.append(model_spec.cross_entropy_mean(logits, labels))
    return (loss, grads, terms, activations,
            [tf.nn.zero_fraction(a) for a in activations])

  def _averaged_gradients(self, images, labels, summaries=None):
    """Runs the towers and averages their gradients, without applying them.

    (With --clip_where per_tower, each tower's are clipped before the
    average; with averaged, `TrainState.clip_averaged` comes after this.)

    Args:
      images: float32 [num_towers, batch, 24, 24, 3].
      labels: int32 [num_towers, batch].

    Args:
      summaries: optional (scalars, histograms) dicts, filled with each
        tower's loss terms, activations and sparsity (tags of
        `common.training.summary_tags`).

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
        if summaries is None:
          loss, grads = self._tower_fn(values, tower_images[i], tower_labels[i])
        else:
          loss, grads, terms, activations, zeros = self._summary_tower_fn(
              values, tower_images[i], tower_labels[i])
          scalars, histograms = summaries
          prefix = training.tower_tag(i, '')[:-1]
          for name, term in zip(training.loss_terms(), terms):
            scalars[training.tower_tag(i, name)] = term
          for layer, x, zero in zip(model_spec.LAYERS, activations, zeros):
            histograms[training.activations_tag(prefix, layer.name)] = x
            scalars[training.sparsity_tag(prefix, layer.name)] = zero
        # With --clip_where per_tower, on the tower's device before the
        # average, as legacy clips inside each tower.
        grads = self.state.clip_tower(grads)
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
    """One training step over all towers; returns tower losses float32 [num_towers]."""
    grads, tower_losses = self._averaged_gradients(images, labels)
    with tf.device(devices.VARIABLE_DEVICE):
      self.state.apply_gradients(self.state.clip_averaged(grads))
    return tower_losses

  def _train_step_with_summaries(self, images, labels):
    """`_train_step`, also returning (scalars, histograms) dicts tag -> tensor:
    each tower's loss terms, activations and sparsity, the averaged gradients."""
    scalars, histograms = {}, {}
    grads, tower_losses = self._averaged_gradients(images, labels,
                                                   (scalars, histograms))
    for name, grad in zip(model_spec.VARIABLE_NAMES, grads):
      histograms[training.gradients_tag(name)] = grad
    with tf.device(devices.VARIABLE_DEVICE):
      self.state.apply_gradients(self.state.clip_averaged(grads))
    return tower_losses, scalars, histograms

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

  def train_step_with_summaries(self, tower_batches):
    """`train_step` (the same update), and what the summaries need from inside it.

    Returns:
      (tower losses float32 tensor [num_towers], scalars, histograms): dicts
      tag -> tensor of `common.training.summary_tags`, the towers' loss
      terms and sparsity, their activations and the averaged gradients.
    """
    return self._summary_step_fn(*self._check(tower_batches))

  def step_graph(self, tower_batches, summaries=False):
    """The traced graph of the step (`summaries`: of the summary step) for these batches."""
    fn = self._summary_step_fn if summaries else self._train_step_fn
    return fn.get_concrete_function(*self._check(tower_batches)).graph

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
