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
from tensorboard.plugins.histogram import metadata as histogram_metadata

from cifar10_towers.common import devices
from cifar10_towers.common import hparams
from cifar10_towers.common import lrn
from cifar10_towers.common import model_spec
from cifar10_towers.common import optimizer as optimizer_lib
from cifar10_towers.modern import model as model_lib
from cifar10_towers.common import tags


def tower_loss(model, images, labels, params=None, activation_hook=None):
  """Total loss of one tower on its own batch (upstream `tower_loss`).

  Args:
    model: Cifar10Model.
    images: float32 [batch, 24, 24, 3].
    labels: int32 [batch].
    params: optional `model.params(values)`; default the model's variables.
    activation_hook: optional callable(tensor) given each layer's output
      (the summary step's; upstream's tower_loss wrote its summaries too).

  Returns:
    float32 scalar: the batch's mean cross-entropy + each weight-decay term
    once. (Upstream filtered the 'losses' collection by the tower's name scope
    for the same reason: weight decay counted once per tower.)
  """
  return model.loss(model.inference(images, params, activation_hook), labels, params)


def average_gradients(tower_grads):
  """Per variable, the mean of the towers' gradients (upstream `average_gradients`).

  Args:
    tower_grads: list over towers of lists of (gradient, variable), every
      tower listing the same variables in the same order.

  Returns:
    list of (averaged gradient, variable), in that order.
  """
  # grad_and_vars: ((grad_tower0, var), ..., (grad_towerN-1, var)). The sum in tower
  # order, then divided by N: bit for bit what legacy's reduce_mean over the
  # [N, *var.shape] concat computes, without copying the gradients into it (2 towers at
  # batch 4: 4-11% of a step, docs/performance.md). Named Mean, as legacy's op is.
  return [(tf.math.truediv(tf.add_n([g for g, _ in grad_and_vars]), len(grad_and_vars),
                           name='Mean'), grad_and_vars[0][1])
          for grad_and_vars in zip(*tower_grads)]


def clip(grads, clip_norm):
  """`tf.clip_by_global_norm` of a list of gradients (what legacy's graph runs)."""
  with tf.name_scope('clip_gradients'):
    return tf.clip_by_global_norm(grads, clip_norm)[0]


# The updates of TF1's optimizers, kernel for kernel (their _resource_apply_dense
# and _finish), so that legacy and modern agree to the last bit but for the
# gradients' own rounding. Each takes (var, grad, lr, the OptimizerSpec, then the
# variable's slots and the optimizer's non-slot variables in
# common.optimizer's order); a table so that a test can break one.
UPDATES = {
    # var -= lr * grad.
    optimizer_lib.SGD: lambda var, grad, lr, _: var.assign_sub(lr * grad),
    # accum = momentum * accum + grad; var -= lr * accum.
    optimizer_lib.MOMENTUM: lambda var, grad, lr, spec, accum: tf.raw_ops.ResourceApplyMomentum(
        var=var.handle, accum=accum.handle, lr=lr, grad=grad, momentum=spec.momentum),
    # m, v updated, var -= lr_t * m / (sqrt(v) + epsilon) with the bias correction
    # lr_t = lr * sqrt(1 - beta2_power) / (1 - beta1_power), beta*_power = beta* ** step.
    optimizer_lib.ADAM: lambda var, grad, lr, spec, m, v, b1_power, b2_power: (
        tf.raw_ops.ResourceApplyAdam(
            var=var.handle, m=m.handle, v=v.handle, beta1_power=b1_power,
            beta2_power=b2_power, lr=lr, beta1=spec.adam_beta1, beta2=spec.adam_beta2,
            epsilon=spec.adam_epsilon, grad=grad)),
}


def _assign(what, given, targets):
  """Sets each tf.Variable of the dict `targets` to the array of the same name in `given`.

  Raises:
    ValueError: a name is missing or unknown, or a shape is wrong
      (TensorFlow's message names the variable).
  """
  if set(given) != set(targets):
    raise ValueError(f'{what}: missing {sorted(set(targets) - set(given))}, '
                     f'unknown {sorted(set(given) - set(targets))}')
  for name, var in targets.items():
    var.assign(tf.cast(given[name], tf.float32))


class TrainState:
  """What a step changes: the model, the optimizer's slots, the global step
  and the moving averages.

  Created under a tf.distribute strategy's scope, the variables are mirrored
  (one copy per replica); `apply_gradients` then takes the strategy's
  `extended.update` to update every copy.

  Attributes:
    model: Cifar10Model.
    optimizer: common.optimizer.OptimizerSpec.
    global_step: int64 tf.Variable on VARIABLE_DEVICE.
    ema: modern.model.MovingAverages.
    decay_steps: int, steps between learning-rate decays.
    slots: dict legacy slot name ('conv1/weights/Adam', 'beta1_power', ...) ->
      tf.Variable of the optimizer (none for SGD).
  """

  def __init__(self, plan, decay_steps, optimizer):
    """Creates the variables (initial values from the tf.random global seed).

    Args:
      plan: common.devices.DevicePlan the towers run on.
      decay_steps: int >= 1, `runtime.training.checked_decay_steps(...)`.
      optimizer: common.optimizer.OptimizerSpec.
    """
    self.decay_steps = decay_steps
    # Deviation from upstream: CPU towers compute the LRN with common.lrn's XLA functions.
    # The same function as tf.nn.lrn to ~4e-7 relative (tests/test_lrn.py).
    self.model = model_lib.Cifar10Model(lrn=lrn.for_plan(plan))
    self.ema = model_lib.MovingAverages(self.model)
    self.optimizer = optimizer
    with tf.device(devices.VARIABLE_DEVICE):
      self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name='global_step')
      # As TF1's optimizers create them (OptimizerSpec.initial_value); float32, as tf.fill
      # of a Python float is.
      self.slots = {
          name: tf.Variable(tf.fill(optimizer_lib.slot_shape(name), optimizer.initial_value(name)),
                            trainable=False, name=name)
          for name in optimizer.slot_names()}

  def clip_tower(self, grads, scale):
    """One tower's gradients, clipped by their global norm if --clip_where per_tower.

    Args:
      grads: list of one tower's gradients.
      scale: the factor the gradients carry (a replica's 1/R): the bound is
        scaled with them, so the result is scale x the clipped gradients.
    """
    return (clip(grads, self.optimizer.clip_norm * scale) if self.optimizer.clips_per_tower
            else grads)

  def clip_averaged(self, grads):
    """The averaged gradients, clipped by their global norm if --clip_where averaged."""
    return clip(grads, self.optimizer.clip_norm) if self.optimizer.clips_averaged else grads

  def apply_gradients(self, grads, update=lambda var, fn, args=(): fn(var, *args)):
    """The optimizer's update at upstream's decayed rate, the step's increment, the averages.

    Args:
      grads: list of averaged gradients in VARIABLE_NAMES order, already
        clipped (`clip_averaged`).
      update: callable(var, fn, args=()) running fn(copy, *args) on every copy
        of `var` (a strategy's `extended.update`, which hands fn each
        replica's own copy of the variables in args too); default: the one copy.
    """
    spec = self.optimizer
    non_slots = [self.slots[name] for name in optimizer_lib.NON_SLOT_NAMES[spec.name]]
    with tf.name_scope('update'):
      # Read before the increment, as exponential_decay inside legacy's
      # apply_gradients reads it.
      lr = model_spec.learning_rate(self.global_step, self.decay_steps,
                                    spec.learning_rate)
      for name, grad, var in zip(model_spec.VARIABLE_NAMES, grads,
                                 self.model.variable_list()):
        slots = [self.slots[f'{name}/{suffix}']
                 for suffix in optimizer_lib.SLOT_SUFFIXES[spec.name]]
        update(var, UPDATES[spec.name], args=(grad, lr, spec, *slots, *non_slots))
      # After every variable's update, as AdamOptimizer._finish does
      # (tf.function orders these writes after the reads above).
      for power, beta in zip(non_slots, (spec.adam_beta1, spec.adam_beta2)):
        update(power, lambda p, b=beta: p.assign(p * b))
      self.global_step.assign_add(1)
    with tf.name_scope('moving_average'):
      # Deviation from upstream: the moving averages see the updated variables and the new step.
      # Legacy applies the moving averages under control_dependencies on
      # apply_gradients, so they see the new weights and the incremented
      # step. tf.function keeps program order for ops on the same variable.
      one_minus_decay = 1.0 - model_spec.ema_decay(self.global_step)
      for shadow, var in zip(self.ema.variable_list(), self.model.variable_list()):
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
    _assign('values', values, self.variables())
    _assign('shadow_values', values if shadow_values is None else shadow_values,
            self.shadow_variables())


class TowerStep:
  """The tower step: one tf.function tower per device of the plan.

  The base of `modern.engines.ReplicaStep`, the same step on the
  replicas of a tf.distribute strategy, which overrides where the towers'
  gradients meet (`_gradients`) and how the update reaches the variables
  (`_apply`).

  Attributes:
    plan: common.devices.DevicePlan, tower i runs on plan.tower_devices[i].
    strategy: the tf.distribute.Strategy the state was created in (here the
      default one: no distribution).
    num_towers: int, the towers (replicas) of one step.
    state: TrainState.
  """

  # Each tower's loss is divided by this before its gradients are taken: 1
  # here, where average_gradients takes the mean; a replica's R, where an
  # all-reduce sums them.
  grad_divisor = 1
  # Whether the step can return what the summaries need from inside it.
  inner_summaries = True

  def __init__(self, plan, decay_steps, jit=False,
               optimizer=optimizer_lib.OptimizerSpec(), strategy=None):
    """Creates the state (see TrainState) and the step's functions.

    Args:
      plan: common.devices.DevicePlan.
      decay_steps: int >= 1, `runtime.training.checked_decay_steps(...)`.
      jit: bool, compile each tower's forward and backward pass with XLA.
      optimizer: common.optimizer.OptimizerSpec; default upstream's SGD.
      strategy: the tf.distribute.Strategy to create the state in.
    """
    self.plan = plan
    self.strategy = strategy or tf.distribute.get_strategy()
    with self.strategy.scope():
      self.state = TrainState(plan, decay_steps, optimizer)
    self.num_towers = plan.num_towers
    # Not a whole-step jit_compile: XLA compiles one device's ops
    # and cannot read variables that live on another device, so with `jit`
    # each tower's loss-and-gradients function (which receives the variables'
    # values as arguments) is compiled for its own device.
    self._tower_fn = tf.function(self._tower, jit_compile=True) if jit else self._tower
    self._traced = {}  # summaries -> `next_step`'s concrete function

  def _tower(self, values, images, labels, summaries=False):
    """One tower: its loss and the gradients w.r.t. the variables' values.

    Args:
      values: list of tensors, the variables' values in VARIABLE_NAMES order.
      images: float32 [batch, 24, 24, 3].
      labels: int32 [batch].
      summaries: bool, also return what the summaries need.

    Returns:
      (loss float32 scalar, list of gradients of loss / grad_divisor shaped
      like `values`, clipped by their global norm with --clip_where
      per_tower, summary): with `summaries`, a dict tag -> tensor of the loss
      terms (`tags.loss_terms()`), the layers' activations and their
      fractions of zeros, each tag without the tower's 'tower_<i>/'; else empty.
    """
    model = self.state.model
    activations = []
    with tf.GradientTape() as tape:
      tape.watch(values)
      params = model.params(values)
      # The forward pass with a hook keeping each layer's output (for the
      # summaries; it adds no op).
      loss = tower_loss(model, images, labels, params, activations.append)
      # Why 1/R on the replicas: the all-reduce SUMs the replicas' gradients,
      # and docs/equivalence.md §2 wants the towers' MEAN of the per-tower
      # gradients, each tower's loss being its batch's mean cross-entropy
      # plus the weight decay once:
      #   sum_r grad(loss_r / R) = (1/R) sum_r grad(CE_r + WD)
      #                          = mean_r grad(CE_r) + grad(WD).
      # So weight decay is counted once in total (not R times, upstream's
      # collection bug), and the result is the gradient of the mean loss over
      # all R * batch images. Scaling the loss by a power of two (R = 2, 4)
      # scales every backpropagated value exactly, so the sum matches the
      # towers' reduce_mean to the last bit but for the summation order.
      share = loss / self.grad_divisor
    # --clip_where per_tower: this tower's own gradients, by their global
    # norm, before they meet (legacy clips inside each tower); they carry the
    # 1/R, so does the bound.
    grads = self.state.clip_tower(tape.gradient(share, values), 1.0 / self.grad_divisor)
    summary = {}
    if summaries:  # tags below the tower's own; the last layer's output is the logits
      summary = dict(zip(tags.loss_terms(), model.loss_terms(activations[-1], labels, params)))
      for layer, x in zip(model_spec.LAYERS, activations):
        summary[tags.activations_tag('', layer.name)] = x
        summary[tags.sparsity_tag('', layer.name)] = tf.nn.zero_fraction(x)
    return loss, grads, summary

  def _gradients(self, images, labels, summaries=False):
    """Runs the towers and averages their gradients, without applying them.

    (With --clip_where averaged, `TrainState.clip_averaged` comes after this.)

    Args:
      images: float32 [num_towers, batch, 24, 24, 3].
      labels: int32 [num_towers, batch].
      summaries: bool, also return each tower's loss terms, activations and
        sparsity (tags of `common.tags.summary_tags`).

    Returns:
      (list of averaged gradients in VARIABLE_NAMES order,
       tower total losses float32 [num_towers],
       dict tag -> tensor of the summaries, empty without `summaries`).
    """
    variables = self.state.model.variable_list()
    with tf.device(devices.VARIABLE_DEVICE):
      # Each tower gets its own batch of the one pipeline (legacy: each tower
      # dequeues its own batch from the shared prefetch queue).
      # (One per tower: the traced step checked the static shapes.)
      tower_images, tower_labels = tf.unstack(images), tf.unstack(labels)
      # The variables are read once on their device; each tower receives a
      # copy of the values (legacy: towers read the CPU variables).
      values = [var.read_value() for var in variables]
    tower_grads, tower_losses, summary = [], [], {}
    for i, device in enumerate(self.plan.tower_devices):
      with tf.device(device), tf.name_scope(f'{hparams.TOWER_NAME}_{i}'):
        loss, grads, tower_summary = self._tower_fn(values, tower_images[i], tower_labels[i],
                                                    summaries)
      summary.update((tags.tower_tag(i, tag), x) for tag, x in tower_summary.items())
      tower_losses.append(loss)
      tower_grads.append(list(zip(grads, variables)))
    # Synchronization point: the towers meet here, once, when every gradient of every
    # tower exists (as in legacy's traces). Begun per variable as soon as that variable's
    # gradients existed, the averaging (and the update after it) took an inter-op thread
    # from a tower still computing: towers overlapped 0.72, now 0.85 (docs/performance.md).
    # One tower has none to meet: its first layers' backward pass and the last layers'
    # updates run side by side, as in legacy (a step 2-6% faster, docs/performance.md).
    meet = [g for grads in tower_grads for g, _ in grads] if len(tower_grads) > 1 else []
    with tf.device(devices.VARIABLE_DEVICE), tf.name_scope('average_gradients'), \
        tf.control_dependencies(meet):
      # Each tower's loss is its own batch's mean cross-entropy plus one weight-decay
      # term, exactly as legacy's tower_loss; gradients are linear, so the per-variable
      # mean over towers of these per-tower gradients is what legacy's
      # average_gradients computes (the same sum and division), and - with equal batch
      # sizes - the gradient of the mean loss over all N*batch images with weight decay
      # counted once. Nothing is summed across replicas implicitly.
      grads = [g for g, _ in average_gradients(tower_grads)]
      return grads, tf.stack(tower_losses), summary

  def _apply(self, grads):
    """Clips the averaged gradients (--clip_where averaged) and applies them."""
    with tf.device(devices.VARIABLE_DEVICE):
      self.state.apply_gradients(self.state.clip_averaged(grads))

  def _step_ops(self, images, labels, summaries=False, apply=True):
    """One training step over all towers (`apply` False: without the update).

    The batches are converted (images float32, labels int32) and their static
    shapes checked here: inside a trace, once.

    Returns:
      (tower losses float32 [num_towers], summary, the averaged gradients the
       step applied (before --clip_where averaged clips them), in
       VARIABLE_NAMES order): with `summaries`, summary is a dict tag -> tensor
       of each tower's loss terms, activations and sparsity, and the averaged
       gradients; else empty.
    """
    images, labels = tf.cast(images, tf.float32), tf.cast(labels, tf.int32)
    size = hparams.IMAGE_SIZE
    # A batch per tower (replica) of the whole run, or of this process (the plan's).
    counts = sorted({self.num_towers, self.plan.num_towers})
    # (The dimensions after the first two first: a rank below 2 fails there.)
    if (images.shape[2:] != (size, size, 3) or images.shape[0] not in counts
        or labels.shape != images.shape[:2]):
      raise ValueError(f'images must be [N, batch, {size}, {size}, 3] and labels [N, batch] '
                       f'with N in {counts} (a batch per tower), got '
                       f'{images.shape} and {labels.shape}')
    grads, tower_losses, summary = self._gradients(images, labels, summaries)
    if summaries:
      summary.update((tags.gradients_tag(name), grad)
                     for name, grad in zip(model_spec.VARIABLE_NAMES, grads))
    if apply:
      self._apply(grads)
    return tower_losses, summary, grads

  # `summaries` (a Python bool) traces the step of the steps that write
  # summaries apart: the same arithmetic, and what the summaries need from
  # inside it; the other steps run the plain step unchanged. `apply` (a Python bool
  # too) False traces the step without its update, for compute_gradients. No
  # autograph: the step is Python that builds ops, with no `if` or `for` over
  # a tensor to convert, and converting it cost a modern process 1 s of its start.
  _step = tf.function(_step_ops, autograph=False)

  def next_step(self, iterator, summaries=False):
    """The training loop's step: the step on the next batch of `iterator`, read inside it.

    Read by next() in Python and handed in, a batch cost a step ~1 ms of host
    time more than read here, and tf.function's dispatch of its arguments as
    much again (docs/performance.md). Any iterator of the same element spec
    runs the same trace. The trace is called as its concrete function, one per
    `summaries`: tf.function's own call, which matches its arguments' types
    to a trace at every call, cost a step 0.4-0.8 ms more of the main thread.

    Returns:
      (tower losses float32 [num_towers], each tower's total loss before the
       update; with `summaries`, a dict tag -> tensor of `common.tags.summary_tags`
       (the towers' loss terms, activations and sparsity, the averaged
       gradients), else empty; with it, the
       images of the image summaries: tower 0's first NUM_SUMMARY_IMAGES,
       else ()).
    """
    step, summaries = self._traced_step(iterator, summaries)
    return step(iterator, summaries)

  def _traced_step(self, iterator, summaries):
    """(`_next_step`'s concrete function, the `summaries` it takes): the replica
    engines, which return no summaries from inside the step, have one trace."""
    summaries = summaries and self.inner_summaries
    if summaries not in self._traced:
      self._traced[summaries] = self._next_step.get_concrete_function(iterator, summaries)
    return self._traced[summaries], summaries

  @tf.function(autograph=False)
  def _next_step(self, iterator, summaries):
    images, labels = iterator.get_next()
    # Nothing of the step runs without its batch: an input that fails to read
    # leaves the variables and the global step as they were.
    with tf.control_dependencies([images, labels]):
      tower_losses, summary, _ = self._step_ops(images, labels, summaries)
    return tower_losses, summary, images[0][:tags.NUM_SUMMARY_IMAGES] if summaries else ()

  # Deviation from upstream: both trainers write the tags of common.tags.summary_tags.
  # Computed and written in one traced function, as legacy fetches one merged
  # summary op: eager summary calls, op by op, cost a summary step ~3x legacy's.
  @tf.function(autograph=False)
  def write_summaries(self, writer, step, tower_losses, summary, images):
    """Writes the tags of common.tags.summary_tags to `writer` at global step `step`.

    Args:
      writer: the tf.summary writer.
      step: int64 scalar, the global step reached.
      tower_losses: float32 [num_towers], `next_step`'s tower losses.
      summary: `next_step`'s summary (empty for the replica engines, which write
        no images either).
      images: float32 [NUM_SUMMARY_IMAGES, 24, 24, 3], `next_step`'s.
    """
    state = self.state
    # The learning rate the step just taken used (read before the increment).
    lr = model_spec.learning_rate(step - 1, state.decay_steps, state.optimizer.learning_rate)
    values = {tags.MEAN_LOSS_TAG: tf.reduce_mean(tower_losses), tags.LEARNING_RATE_TAG: lr,
              **summary, **state.variables(),
              # Deviation from upstream: every tower's loss summary is written.
              **{tags.tower_tag(i, 'total_loss'): tower_losses[i]
                 for i in range(self.num_towers)},
              **{model_spec.average_name(name): var
                 for name, var in state.shadow_variables().items()}}
    with writer.as_default(step=step):
      for tag, value in values.items():  # a histogram of each tensor, a scalar of each scalar
        value = tf.convert_to_tensor(value)
        (histogram if value.shape.rank else tf.summary.scalar)(tag, value)
      if summary:  # the tags of tags.image_tags()
        for tag, image in zip(tags.image_tags(), tf.unstack(images)):
          tf.summary.image(tag, _displayable(image)[tf.newaxis])

  def train_step(self, tower_batches):
    """One training step on given batches (the loop's, `next_step`, reads its own).

    Args:
      tower_batches: (images float32 [N, batch, 24, 24, 3],
        labels int32 [N, batch]); tower i trains on images[i], labels[i].

    Returns:
      float32 tensor [num_towers]: each tower's total loss before the update.
    """
    # Nothing is converted or checked here, per step: the traced step converts
    # and checks the batches once per trace.
    return self._step(*tower_batches)[0]

  def step_graph(self, iterator, summaries=False):
    """The traced graph of `next_step` (`summaries`: of the summary step) on `iterator`."""
    return self._traced_step(iterator, summaries)[0].graph

  def compute_gradients(self, tower_batches, apply=False):
    """The averaged gradients at the current variables.

    Args:
      tower_batches: as for `train_step`.
      apply: bool, take the training step (`train_step`'s traced step) and return
        the gradients it applied; else apply nothing.

    Returns:
      (dict variable name -> averaged gradient tensor, in VARIABLE_NAMES
       order; tower total losses float32 [num_towers]).
    """
    tower_losses, _, grads = self._step(*tower_batches, apply=apply)
    # One copy of each (identical on every replica after the all-reduce).
    return {name: self.strategy.experimental_local_results(grad)[0] for name, grad in
            zip(model_spec.VARIABLE_NAMES, grads)}, tower_losses


def _displayable(image):
  """A float image scaled into [0, 1] as TF1's image summary scales it.

  Non-negative images: the largest value becomes 1. Otherwise 0 goes to
  127/255 and the image is scaled so that its smallest value is 0 or its
  largest 1 (tf.summary.image clips what lies outside [0, 1]). The scale is
  computed in float64 and applied in float32.
  """
  low, high = tf.reduce_min(image), tf.reduce_max(image)
  low64, high64 = tf.cast(low, tf.float64), tf.cast(high, tf.float64)
  scale = tf.where(high > 0, tf.minimum(127.0 / -low64, 128.0 / high64), 127.0 / -low64)
  return tf.where(low >= 0, tf.where(high > 0, image / high, image),
                  (image * tf.cast(scale, tf.float32) + 127.0) / 255.0)


HISTOGRAM_BUCKETS = 30  # tf.summary.histogram's default
_HISTOGRAM_METADATA = histogram_metadata.create_summary_metadata(display_name=None,
                                                                 description=None)


def histogram(tag, data):
  """tf.summary.histogram: the same [30, 3] (left edge, right edge, count) of `data`.

  Counted by one Bincount, not its one-hot [size, 30] float64 matrix (212 MB
  for local3/weights) and its conds, which cost most of a summary step and of
  its tracing, nor an unsorted segment sum (six times Bincount's time). A
  single value: every edge is it, the last bucket counts all, as there; a NaN
  (or an infinity's NaN) counts nowhere, as there.
  """
  data = tf.cast(tf.reshape(data, [-1]), tf.float64)
  low, high = tf.reduce_min(data), tf.reduce_max(data)
  spread = tf.not_equal(high - low, 0.0)  # NaN bounds too: there, a single value is range == 0
  width = tf.where(spread, (high - low) / HISTOGRAM_BUCKETS, 1.0)
  index = tf.minimum(tf.cast(tf.floor((data - low) / width), tf.int32), HISTOGRAM_BUCKETS - 1)
  # A NaN's index is negative (so is one past int32, which only a denormal width gives);
  # Bincount rejects negatives and ignores values >= its size: both count nowhere, as there.
  counts = tf.raw_ops.Bincount(arr=tf.where(index < 0, HISTOGRAM_BUCKETS, index),
                               size=HISTOGRAM_BUCKETS, weights=tf.zeros([0], tf.float64))
  counts = tf.where(spread, counts, tf.one_hot(HISTOGRAM_BUCKETS - 1, HISTOGRAM_BUCKETS,
                                               on_value=tf.cast(tf.size(data), tf.float64),
                                               dtype=tf.float64))
  # The kernel: tf.linspace's composite ops, traced with a constant count, are
  # constant-folded into other roundings. The last edge is exactly the largest value.
  edges = tf.concat(
      [tf.raw_ops.LinSpace(start=low, stop=high, num=HISTOGRAM_BUCKETS + 1)[:-1], [high]], 0)
  tf.summary.write(tag, tf.stack([edges[:-1], edges[1:], counts], axis=1),
                   metadata=_HISTOGRAM_METADATA)
