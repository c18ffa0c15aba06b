"""Multi-tower training in TF2: tf.function towers, averaged gradients, SGD, moving averages.

The algorithm of upstream `cifar10_multi_gpu_train.py` (docs/equivalence.md §1) without
`tf.compat.v1`: the variables live on `devices.VARIABLE_DEVICE`; each step
reads them once there, sends the values to N towers (one per device of the
`DevicePlan`), each tower computes its own batch's loss and gradients, the
gradients meet on the variables' device to be averaged, and plain gradient
descent, the global step and the moving averages are updated there.

No Keras optimizer: `tf.keras.optimizers.SGD` under a distribution strategy
sums gradients across replicas implicitly, which changes the arithmetic the
equivalence contract (docs/equivalence.md §2) compares. The update is written out instead.
"""

import contextlib
import time

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import summary_pb2

from common import checkpoints
from common import cifar10_format as fmt
from common import config as config_lib
from common import devices
from common import hparams
from common import lock
from common import model_spec
from common import training
from common import lrn
from modern import checkpoints as ckpt_lib
from modern import inputs
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


class Trainer:
  """The model, the global step and the moving averages, and the tower step.

  Attributes:
    plan: common.devices.DevicePlan, tower i runs on plan.tower_devices[i].
    num_towers: int.
    decay_steps: int, steps between learning-rate decays.
    model: Cifar10Model.
    global_step: int64 tf.Variable on VARIABLE_DEVICE.
    ema: modern.model.MovingAverages.
  """

  def __init__(self, plan, decay_steps, jit=False):
    """Creates the variables (initial values from the tf.random global seed).

    Args:
      plan: common.devices.DevicePlan.
      decay_steps: int >= 1, `hparams.decay_steps(...)`.
      jit: bool, compile each tower's forward and backward pass with XLA.
    """
    if decay_steps < 1:
      raise ValueError('decay_steps must be >= 1, got %d' % decay_steps)
    self.plan = plan
    self.num_towers = plan.num_towers
    self.decay_steps = int(decay_steps)
    # Deviation from upstream: CPU towers compute the LRN with common.lrn's XLA functions.
    # The same function as tf.nn.lrn to ~4e-7 relative (tests/test_lrn.py).
    self.model = model_lib.Cifar10Model(lrn=lrn.for_plan(plan))
    with tf.device(devices.VARIABLE_DEVICE):
      self.global_step = tf.Variable(0, dtype=tf.int64, trainable=False,
                                     name='global_step')
    self.ema = model_lib.MovingAverages(self.model)
    # Not a whole-step jit_compile: XLA compiles one device's ops
    # and cannot read variables that live on another device, so with `jit`
    # each tower's loss-and-gradients function (which receives the variables'
    # values as arguments) is compiled for its own device.
    self._tower_fn = (tf.function(self._tower_loss_and_grads, jit_compile=True)
                      if jit else self._tower_loss_and_grads)
    self._train_step_fn = tf.function(self._train_step)
    self._compute_gradients_fn = tf.function(self._averaged_gradients)

  # --- the step -------------------------------------------------------------

  def _tower_loss_and_grads(self, values, images, labels):
    """One tower: its loss and the gradients w.r.t. the variables' values.

    Args:
      values: list of tensors, the variables' values in VARIABLE_NAMES order.
      images: float32 [batch, 24, 24, 3].
      labels: int32 [batch].

    Returns:
      (loss float32 scalar, list of gradients shaped like `values`).
    """
    with tf.GradientTape() as tape:
      tape.watch(values)
      loss = tower_loss(self.model, images, labels, self.model.params(values))
    return loss, tape.gradient(loss, values)

  def _averaged_gradients(self, images, labels):
    """Runs the towers and averages their gradients, without applying them.

    Args:
      images: float32 [num_towers, batch, 24, 24, 3].
      labels: int32 [num_towers, batch].

    Returns:
      (list of (averaged gradient, variable) in VARIABLE_NAMES order,
       tower total losses float32 [num_towers]).
    """
    variables = self.model.variable_list()
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
    with tf.device(devices.VARIABLE_DEVICE):
      # Synchronization point: the towers meet here. Each tower's loss is its
      # own batch's mean cross-entropy plus one weight-decay term, exactly as
      # legacy's tower_loss; gradients are linear, so the per-variable mean
      # over towers of these per-tower gradients is what legacy's
      # average_gradients computes (the same reduce_mean over the stacked
      # tower gradients), and - with equal batch sizes - the gradient of the
      # mean loss over all N*batch images with weight decay counted once.
      # Nothing is summed across replicas implicitly.
      grads_and_vars = average_gradients(tower_grads)
      return grads_and_vars, tf.stack(tower_losses)

  def _train_step(self, images, labels):
    """One SGD step over all towers; returns tower losses float32 [num_towers]."""
    grads_and_vars, tower_losses = self._averaged_gradients(images, labels)
    with tf.device(devices.VARIABLE_DEVICE):
      # Read before the increment, as exponential_decay inside legacy's
      # apply_gradients reads it.
      lr = model_spec.learning_rate(self.global_step, self.decay_steps)
      for grad, var in grads_and_vars:
        var.assign_sub(lr * grad)
      self.global_step.assign_add(1)
      # Deviation from upstream: the moving averages see the updated variables and the new step.
      # Legacy applies the moving averages under control_dependencies on
      # apply_gradients, so they see the new weights and the incremented
      # step. tf.function keeps program order for ops on the same variable.
      self.ema.apply(self.model, model_spec.ema_decay(self.global_step))
    return tower_losses

  def _batch_counts(self):
    """The leading sizes `tower_batches` may have, and how errors name them."""
    return (self.num_towers,), ('%d towers' % self.num_towers, '')

  def _check_batches(self, tower_batches):
    images, labels = tower_batches
    images = tf.convert_to_tensor(images, tf.float32)
    labels = tf.convert_to_tensor(labels, tf.int32)
    size = hparams.IMAGE_SIZE
    counts, (leading, note) = self._batch_counts()
    if (images.shape.rank != 5 or images.shape[0] not in counts
        or tuple(images.shape[2:]) != (size, size, 3)):
      raise ValueError('images must be [%s, batch, %d, %d, 3]%s, got %s'
                       % (leading, size, size, note, images.shape))
    if tuple(labels.shape) != tuple(images.shape[:2]):
      raise ValueError('labels must be %s, got %s'
                       % (tuple(images.shape[:2]), labels.shape))
    return images, labels

  def train_step(self, tower_batches):
    """Runs one training step.

    Args:
      tower_batches: (images float32 [num_towers, batch, 24, 24, 3],
        labels int32 [num_towers, batch]), e.g. an element of
        `inputs.distorted_inputs`; tower i trains on images[i], labels[i].

    Returns:
      float32 tensor [num_towers], each tower's total loss (before the update).
    """
    return self._train_step_fn(*self._check_batches(tower_batches))

  def compute_gradients(self, tower_batches):
    """The averaged gradients at the current variables, without applying them.

    Args:
      tower_batches: as for `train_step`.

    Returns:
      (dict variable name -> averaged gradient tensor, in VARIABLE_NAMES
       order; tower total losses float32 [num_towers]).
    """
    grads_and_vars, tower_losses = self._compute_gradients_fn(
        *self._check_batches(tower_batches))
    return ({name: grad for name, (grad, _) in
             zip(model_spec.VARIABLE_NAMES, grads_and_vars)}, tower_losses)

  # --- state access (for the cross-check harness and tests) ----------------

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


# tf.summary.scalar / tf.summary.histogram are implemented by the tensorboard
# package, which tensorflow no longer installs; these write the same records
# (a tensor plus the plugin's name, as TensorBoard's scalars and histograms
# plugins read them) with core tf.summary.write.
_SCALARS_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name='scalars'))
_HISTOGRAMS_METADATA = summary_pb2.SummaryMetadata(
    plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name='histograms'))
_HISTOGRAM_BUCKETS = 30  # TensorBoard's default


def _scalar_summary(name, value, step):
  tf.summary.write(name, tf.constant(value, tf.float32), step=step,
                   metadata=_SCALARS_METADATA)


def _histogram_summary(name, values, step):
  """Writes float64 [buckets, 3] rows (left edge, right edge, count)."""
  values = np.asarray(values, np.float64).ravel()
  counts, edges = np.histogram(values, bins=_HISTOGRAM_BUCKETS)
  buckets = np.stack([edges[:-1], edges[1:], counts.astype(np.float64)], axis=1)
  tf.summary.write(name, tf.constant(buckets), step=step,
                   metadata=_HISTOGRAMS_METADATA)


def _write_summaries(trainer, step, tower_losses, lr):
  """Loss (mean and per tower), learning rate, weight and average histograms."""
  # Deviation from upstream: every tower's loss summary is written.
  _scalar_summary('loss', tower_losses.mean(), step)
  for i, value in enumerate(tower_losses):
    _scalar_summary('%s_%d/total_loss' % (TOWER_NAME, i), value, step)
  _scalar_summary('learning_rate', lr, step)
  for name, var in trainer.variables().items():
    _histogram_summary(name, var.numpy(), step)
  for name, var in trainer.shadow_variables().items():
    _histogram_summary('%s/%s' % (name, model_spec.EMA_SUFFIX), var.numpy(), step)


def train(config, plan, out=print, warn=training.stderr, on_step=None):
  """Trains until global_step == config.max_steps, resuming from train_dir.

  Args:
    config: common.config.TrainConfig; config.strategy 'mirrored' or
      'multiworker' hands the run to `modern.distributed.train`.
    plan: common.devices.DevicePlan with config.num_gpus tower devices.
    out: callable(str) for progress lines (stdout).
    warn: callable(str) for diagnostics (stderr).
    on_step: optional callable(step, seconds, images) after every step: the
      global step reached, the step's wall seconds, and the images it
      trained on over all replicas (bench paces itself with it).

  Returns:
    int, the global step reached (max_steps, or less if stopped by a signal).

  Raises:
    common.cifar10_format.DataError: training data missing or malformed.
    common.training.TrainingError: the loss diverged, or train_dir holds a
      checkpoint this trainer cannot resume.
    common.checkpoints.CheckpointError: the latest checkpoint is damaged or
      of another model, or a write into train_dir failed (e.g. disk full).
    common.lock.LockError: another run trains in train_dir.
    common.training.Stopped: SIGINT or SIGTERM came before the first step
      was done; nothing was written.
    ValueError: the plan does not match config.num_gpus.
  """
  if plan.num_towers != config.num_gpus:
    raise ValueError('the device plan has %d towers, config.num_gpus is %d'
                     % (plan.num_towers, config.num_gpus))
  if config.strategy != 'towers':
    # The tf.distribute engines (MirroredStrategy, MultiWorkerMirroredStrategy)
    # run this step and loop in modern/distributed.py, which imports this module.
    from modern import distributed  # pylint: disable=g-import-not-at-top
    return distributed.train(config, plan, out=out, warn=warn, on_step=on_step)
  if config.seed is not None:
    tf.random.set_seed(config.seed)
  if config.log_device_placement:
    tf.debugging.set_log_device_placement(True)

  # Deviation from upstream: train_dir is never deleted; training resumes.
  # The lock creates it if missing. One run at a
  # time: a second one would write the same steps and overwrite the first's
  # checkpoints.
  with training.StopRequest() as stop, lock.exclusive(config.train_dir,
                                                      what='modern training'):
    # Until the first step nothing is written: a stop ends the run at once.
    with stop.raising():
      filenames = fmt.train_files(config.data_dir)
      # Deviation from upstream: the epoch size is what is on disk, not 50000.
      examples_per_epoch = fmt.num_examples(filenames)
      decay_steps = training.checked_decay_steps(
          examples_per_epoch, config.batch_size, config.num_gpus)
      trainer = Trainer(plan, decay_steps, jit=config.jit)
      checkpoint = ckpt_lib.checkpoint_object(trainer)
      resume_from = ckpt_lib.restore_latest(config.train_dir, checkpoint, warn)
      manager = tf.train.CheckpointManager(  # after restore_latest: see there
          checkpoint, config.train_dir, max_to_keep=ckpt_lib.MAX_TO_KEEP,
          checkpoint_name=config_lib.CHECKPOINT_BASENAME)
      step = int(trainer.global_step.numpy())
      if resume_from:
        out('Resuming from %s at global step %d.' % (resume_from, step))
      if step >= config.max_steps:
        warn(training.nothing_to_train(step, config.max_steps,
                                       config.train_dir))
        return step
      iterator = iter(inputs.distorted_inputs(
          config.data_dir, config.batch_size, config.num_gpus,
          seed=config.seed))
    save = ckpt_lib.StepSaver(trainer, manager, config.train_dir,
                     last_saved=step if resume_from else None)
    return _train_loop(config, trainer, iterator, save, decay_steps, stop, out,
                       warn, on_step)


def _train_loop(config, trainer, iterator, save, decay_steps, stop, out, warn,
                on_step):
  """The steps, with log lines, summaries and checkpoints, until max_steps or a stop.

  A stop request (`stop`, a common.training.StopRequest) ends the loop at the
  next step boundary, with a checkpoint of that step.

  Returns:
    int, the global step reached.

  Raises:
    common.training.Stopped: the stop came before or during this run's
      first step.
  """
  step = first_step = int(trainer.global_step.numpy())
  writer = None  # opened after the first step: a stop before it writes nothing
  while step < config.max_steps and not stop.requested:
    # The first step traces and compiles the step function and fills the
    # shuffle buffer: seconds, tens of seconds on a busy machine, with nothing
    # written yet, so a stop ends it at once.
    with stop.raising() if step == first_step else contextlib.nullcontext():
      start_time = time.time()
      tower_losses = trainer.train_step(next(iterator)).numpy()
    duration = time.time() - start_time
    # Deviation from upstream: 'step N' and model.ckpt-N count the global step after the update.
    # Upstream logged and saved its 0-based loop index.
    step = int(trainer.global_step.numpy())
    training.check_divergence(step, tower_losses)

    if writer is None:
      writer = tf.summary.create_file_writer(config.train_dir)
    if step % config.log_every == 0:
      # Deviation from upstream: the loss logged is the mean over towers, not the last tower's.
      # Deviation from upstream: sec/batch is the time of one step, not divided by the towers.
      out(training.log_line(step, float(tower_losses.mean()),
                            config.global_batch_size / duration, duration))
    if on_step is not None:
      on_step(step, duration, config.global_batch_size)
    if step % config.summary_every == 0:
      # The learning rate the step just taken used (read before the increment).
      lr = float(model_spec.learning_rate(step - 1, decay_steps))
      try:
        with writer.as_default():
          _write_summaries(trainer, step, tower_losses, lr)
      except (tf.errors.OpError, OSError) as e:  # e.g. disk full
        raise checkpoints.write_failed(
            config.train_dir, 'TensorBoard summaries', e) from e
    if step % config.save_every == 0:
      save()
  if step == first_step:  # the stop came before the first step
    raise training.Stopped(stop.signal_name)
  path = save()
  try:
    writer.flush()
  except (tf.errors.OpError, OSError) as e:  # e.g. disk full; checkpoints decide
    warn('could not write the last TensorBoard summaries to %s (%s).'
         % (config.train_dir, str(e).strip().splitlines()[0]))
  if stop.requested:
    out(training.stopped_line(stop.signal_name, step, path))
  return step
