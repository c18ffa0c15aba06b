"""The modern adapter: a few steps of the tf.function trainer under tf.profiler.

The only contact with modern/: `modern.step.Trainer(plan, decay_steps, jit)`,
`Trainer.train_step(batch)` and `inputs.distorted_inputs`.

What the trace holds (tensorflow-cpu 2.21, docs/profile-design.md): the
`.xplane.pb` of `tf.profiler.experimental` has one '/host:CPU' plane whose
lines are threads, not devices; op events are named '<op name>:<op type>'
('tower_1/conv1:_FusedConv2D'). Logical CPU devices share one inter-op
thread pool, so the thread says nothing about the device. The device of an
op comes from, in order: a '/device:GPU:i' plane (kernels of a real GPU);
the source device in the rendezvous key of a '_Send' from that op (where the
op really ran); the device the traced function asks for (on logical CPU
devices every op has a kernel, so the placer keeps it).
"""

import glob
import os
import tempfile
import time

import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2

from cifar10_towers.common import cifar10_format
from cifar10_towers.common import devices
from cifar10_towers.common import hparams
from cifar10_towers.modern import inputs
from cifar10_towers.modern import step as modern_step
from cifar10_towers.towerprofile import analysis

STEP_EVENT = 'towerprofile_step'  # the tf.profiler.experimental.Trace of one step
# The name scopes of modern's step (modern/step.py) that analysis.categorize
# reads as legacy's: the averaging, the update, the moving averages.
STEP_SCOPES = ('average_gradients', 'update', 'moving_average')


def _modern_category(name, op_type, ema_ops=frozenset()):
  """Categories of the modern ops that `analysis.categorize` cannot tell by name.

  Ops under the step's STEP_SCOPES are analysis.categorize's, as legacy's are.

  Returns:
    a category, or None to let analysis.categorize decide.
  """
  first = name.split('/')[0]
  if name in ema_ops:
    return analysis.EMA
  if analysis.tower_of(name) is not None:
    if first == 'gradient_tape' or '/gradients/' in name:
      return analysis.BACKWARD
    return None
  if op_type in ('_Send', '_Recv'):
    return analysis.COPY
  if first in STEP_SCOPES:
    return None
  if op_type in ('IteratorGetNext', 'IteratorGetNextSync'):
    return analysis.INPUT
  if first.startswith('unstack') and op_type == 'Unpack':
    return analysis.INPUT  # each tower's batch out of the one batch (legacy: dequeue_i)
  # The rest on the variable device: the variables' reads for the towers,
  # the clipping ('clip_gradients').
  return analysis.UPDATE


def moving_average_ops(function_def):
  """Names of the ops of the step function that serve only the moving averages.

  Besides their name scope ('moving_average'), by data flow: `model_spec.ema_decay`
  (the one `Minimum` of the step) starts them: what depends on it, and what
  feeds only those (the shadows' reads, `shadow - variable`), is theirs.

  Args:
    function_def: the step's FunctionDef.

  Returns:
    set of op names.
  """
  consumers = {}
  for node in function_def.node_def:
    for source in node.input:
      if not source.startswith('^'):
        consumers.setdefault(source.split(':')[0], set()).add(node.name)
  roots = [n.name for n in function_def.node_def if n.op == 'Minimum'
           and analysis.tower_of(n.name) is None]
  ema, todo = set(), list(roots)
  while todo:  # what depends on the decay
    name = todo.pop()
    if name not in ema:
      ema.add(name)
      todo.extend(consumers.get(name, ()))
  changed = bool(ema)
  while changed:  # what feeds only the moving averages
    changed = False
    for node in function_def.node_def:
      users = consumers.get(node.name)
      if (node.name not in ema and users and users <= ema
          and analysis.tower_of(node.name) is None):
        ema.add(node.name)
        changed = True
  return ema


def graph_facts(trainer, batch):
  """What the traced step says: op name -> requested device, and the EMA ops.

  Returns:
    (dict op name -> canonical device, set of moving-average op names).
  """
  graph_def = tf.function(trainer.train_step).get_concrete_function(
      batch).graph.as_graph_def()
  found = {}
  functions = sorted(graph_def.library.function,
                     key=lambda f: '_train_step' not in f.signature.name)
  for function in functions:  # the step's own function first
    for node in function.node_def:
      device = node.device or devices.VARIABLE_DEVICE  # the default device
      found.setdefault(node.name, analysis.canonical_device(device))
  step = [f for f in functions if '_train_step' in f.signature.name]
  return found, moving_average_ops(step[0]) if step else set()


def _stats(plane, holder):
  out = {}
  for stat in holder.stats:
    key = plane.stat_metadata[stat.metadata_id].name
    if stat.str_value:
      out[key] = stat.str_value
    elif stat.ref_value:
      out[key] = plane.stat_metadata[stat.ref_value].name
    else:
      out[key] = stat.int64_value or stat.uint64_value or stat.double_value
  return out


def events_from_xspace(space, device_of, ema_ops=frozenset()):
  """Normalized events and step windows of an XSpace.

  Args:
    space: xplane_pb2.XSpace.
    device_of: dict op name -> canonical device (see `graph_facts`).
    ema_ops: set of the moving averages' op names (see `graph_facts`).

  Returns:
    (events, windows, sources): list of analysis.Event; per step (start_us,
    end_us); dict op name -> 'gpu_plane' | 'send_key' | 'graph'.
  """
  ops, windows, actual = [], {}, {}
  for plane in space.planes:
    gpu = plane.name.startswith('/device:GPU:')
    if not (gpu or plane.name == '/host:CPU'):
      continue
    for line in plane.lines:
      for event in line.events:
        name = plane.event_metadata[event.metadata_id].name
        start = line.timestamp_ns / 1e3 + event.offset_ps / 1e6
        end = start + event.duration_ps / 1e6
        if name == STEP_EVENT:
          windows[int(_stats(plane, event).get('step_num', 0))] = (start, end)
          continue
        if gpu:
          op = _stats(plane, event).get('tf_op', '')
          if ':' in op:
            op_name, op_type = op.rsplit(':', 1)
            device = analysis.canonical_device(plane.name)
            actual[op_name] = (device, 'gpu_plane')
            ops.append((op_name, op_type, start, end, device))
          continue
        if name == 'IteratorGetNextOp::DoCompute':  # the step waits for input
          ops.append(('IteratorGetNext', 'IteratorGetNext', start, end,
                      analysis.canonical_device(devices.VARIABLE_DEVICE)))
          continue
        if ':' not in name or '::' in name or name.startswith('end: '):
          continue  # runtime regions, not ops
        op_name, op_type = name.rsplit(':', 1)
        if not op_type or op_type != op_type.strip():
          continue  # 'EagerLocalExecute: <op>': the Python side of a call
        if line.name.startswith('tf_data'):
          continue  # the input pipeline's threads: input, but not the step's wait
        if op_type == '_Send':
          key = _stats(plane, event).get('key', '')
          source = _stats(plane, event).get('from', '')
          if key and source:
            actual.setdefault(source, (analysis.canonical_device(
                key.split(';')[0]), 'send_key'))
            device = analysis.canonical_device(key.split(';')[0])
            ops.append((op_name, op_type, start, end, device))
            continue
        ops.append((op_name, op_type, start, end, None))
  order = sorted(windows)
  spans = [windows[k] for k in order]
  events, sources = [], {}
  for op_name, op_type, start, end, device in ops:
    step = next((k for k, (lo, hi) in enumerate(spans) if lo <= start < hi),
                None)
    if step is None:
      continue
    if device is None:
      if op_name in actual:
        device, sources[op_name] = actual[op_name]
      else:
        device = device_of.get(op_name, devices.VARIABLE_DEVICE)
        device = analysis.canonical_device(device)
        sources[op_name] = 'graph'
    events.append(analysis.Event(op_name, op_type, device, start, end, step,
                                 _modern_category(op_name, op_type, ema_ops)))
  return events, spans, sources


def trace(config, plan, steps, warmup=3, trainer_plan=None, logdir=None):
  """Trains `warmup` then `steps` profiled steps; nothing goes to train_dir.

  Args:
    config: common.config.TrainConfig (train_dir is not used).
    plan: common.devices.DevicePlan, the planned devices.
    steps: int >= 1.
    warmup: int, unprofiled steps first (tracing, XLA compiles, prefetch).
    trainer_plan: DevicePlan the trainer builds with, if not `plan`.
    logdir: where the profiler writes; a temporary dir if None.

  Returns:
    (events, windows, wall_us, sources) as in `events_from_xspace`, with
    wall_us the time of each step (next batch and train_step) in Python.
  """
  trainer_plan = trainer_plan or plan
  examples = cifar10_format.num_examples(
      cifar10_format.train_files(config.data_dir))
  decay_steps = max(1, hparams.decay_steps(examples, config.batch_size,
                                           config.num_gpus))
  trainer = modern_step.Trainer(trainer_plan, decay_steps, jit=config.jit)
  iterator = iter(inputs.distorted_inputs(config.data_dir, config.batch_size,
                                          config.num_gpus, seed=config.seed))
  batch = next(iterator)
  device_of, ema_ops = graph_facts(trainer, batch)
  for _ in range(warmup):
    trainer.train_step(next(iterator))
  logdir = logdir or tempfile.mkdtemp(prefix='towerprofile_')
  wall_us = []
  tf.profiler.experimental.start(logdir)
  try:
    for k in range(steps):
      began = time.perf_counter()
      with tf.profiler.experimental.Trace(STEP_EVENT, step_num=k, _r=1):
        losses = trainer.train_step(next(iterator))
        losses.numpy()  # the step ends when its result exists
      wall_us.append((time.perf_counter() - began) * 1e6)
  finally:
    tf.profiler.experimental.stop()
  paths = sorted(glob.glob(os.path.join(logdir, 'plugins', 'profile', '*',
                                        '*.xplane.pb')))
  space = xplane_pb2.XSpace()
  with open(paths[-1], 'rb') as f:
    space.ParseFromString(f.read())
  events, windows, sources = events_from_xspace(space, device_of, ema_ops)
  return events, windows, wall_us, sources
