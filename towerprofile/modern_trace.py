"""The modern adapter: a few steps of the tf.function trainer under tf.profiler.

The only contact with modern/: `modern.step.TowerStep(plan, decay_steps, jit)`,
`TowerStep.next_step(iterator)` (the training loop's step), `TowerStep.step_graph`
and `inputs.distorted_inputs`.

What the trace holds (tensorflow-cpu 2.21, docs/profile-design.md): the
`.xplane.pb` of `tf.profiler.experimental` has one '/host:CPU' plane whose
lines are threads, not devices; op events are named '<op name>:<op type>'
('tower_1/conv1:_FusedConv2D'). Logical CPU devices share one inter-op
thread pool, so the thread says nothing about the device. The device of an
op comes from, in order: a '/device:GPU:i' plane (kernels of a real GPU; one
plane per physical GPU, so on logical GPUs of one GPU the traced function's
device says which);
the source device in the rendezvous key of a '_Send' from that op (where the
op really ran); the device the traced function asks for (on logical CPU
devices every op has a kernel, so the placer keeps it).
"""

import collections
import glob
import time

import tensorflow as tf
from tensorflow.tsl.profiler.protobuf import xplane_pb2

from cifar10_towers.common import devices
from cifar10_towers.modern import inputs
from cifar10_towers.modern import step as modern_step
from cifar10_towers.towerprofile import analysis

STEP_EVENT = 'towerprofile_step'  # the tf.profiler.experimental.Trace of one step
VARIABLE_DEVICE = analysis.canonical_device(devices.VARIABLE_DEVICE)


def graph_facts(trainer, iterator):
  """Op name -> the canonical device the traced step asks for (none: the default device)."""
  graph_def = trainer.step_graph(iterator).as_graph_def()
  found = {}
  # The step's own ops first, then those of the functions it calls.
  for node in [*graph_def.node, *(n for f in graph_def.library.function for n in f.node_def)]:
    found.setdefault(node.name, analysis.canonical_device(node.device or VARIABLE_DEVICE))
  return found


def _stats(plane, holder):
  return {plane.stat_metadata[stat.metadata_id].name:
          stat.str_value or (plane.stat_metadata[stat.ref_value].name if stat.ref_value else
                             stat.int64_value or stat.uint64_value or stat.double_value)
          for stat in holder.stats}


def events_from_xspace(space, device_of, logical_gpus):
  """Normalized events and step windows of an XSpace.

  Args:
    space: xplane_pb2.XSpace.
    device_of: dict op name -> canonical device (see `graph_facts`).
    logical_gpus: whether a GPU is split into logical GPUs (devices.plan_devices):
      its plane then holds the kernels of all of them.

  Returns:
    (events, windows, sources): list of analysis.Event; per step (start_us,
    end_us); dict op name -> 'gpu_plane' | 'send_key' | 'graph'.
  """
  ops, windows, actual = [], [], {}
  for plane in space.planes:
    gpu = plane.name.startswith('/device:GPU:')
    for line in plane.lines if gpu or plane.name == '/host:CPU' else ():
      for event in line.events:
        name, stats = plane.event_metadata[event.metadata_id].name, _stats(plane, event)
        start = line.timestamp_ns / 1e3 + event.offset_ps / 1e6
        span, device = (start, start + event.duration_ps / 1e6), None
        op_name, _, op_type = (stats.get('tf_op', '') if gpu else name).rpartition(':')
        if name == STEP_EVENT:  # the steps follow each other: in order of their starts
          windows.append(span)
          continue
        if gpu:
          device = analysis.canonical_device(plane.name)
          if logical_gpus and device_of.get(op_name, '').startswith('/device:GPU:'):
            device = device_of[op_name]
          actual[op_name] = (device, 'gpu_plane')
        elif name == 'IteratorGetNextOp::DoCompute':  # the step waits for input
          op_name = op_type = 'IteratorGetNext'
          device = VARIABLE_DEVICE
        # Not ops: runtime regions, 'EagerLocalExecute: <op>' (the Python side of a
        # call), the input pipeline's threads (input, but not the step's wait).
        elif ('::' in name or name.startswith('end: ') or op_type != op_type.strip()
              or line.name.startswith('tf_data')):
          continue
        elif op_type == '_Send' and stats.get('key') and stats.get('from'):
          device = analysis.canonical_device(stats['key'].split(';')[0])
          actual.setdefault(stats['from'], (device, 'send_key'))
        if op_name and op_type:
          ops.append((op_name, op_type, span, device))
  windows.sort()
  events, sources = [], {}
  for op_name, op_type, (start, end), device in ops:
    step = next((k for k, (lo, hi) in enumerate(windows) if lo <= start < hi), None)
    if step is not None:
      if device is None:
        device, sources[op_name] = actual.get(op_name) or (
            device_of.get(op_name, VARIABLE_DEVICE), 'graph')
      # What no name tells is on the variable device: the update (the variables'
      # reads for the towers, the clipping).
      events.append(analysis.Event(op_name, op_type, device, start, end, step,
                                   analysis.categorize(op_name, op_type, analysis.UPDATE)))
  return events, windows, sources


def trace(config, plan, decay_steps, steps, warmup):
  """Trains `warmup` then `steps` profiled steps; the profiler writes into train_dir.

  Args:
    config: runtime.config.TrainConfig; its train_dir is the caller's scratch
      dir (run.profile's), where tf.profiler writes the trace.
    plan: common.devices.DevicePlan the trainer builds with.
    decay_steps: int, of the learning rate schedule.
    steps: int >= 1.
    warmup: int, unprofiled steps first (tracing, XLA compiles, prefetch).

  Returns:
    (events, windows, wall_us, extra): events and windows as in
    `events_from_xspace`, wall_us the time of each step (next_step, which
    reads its batch) in Python, extra the report's 'placement_sources': how many
    ops' devices came from each source (`events_from_xspace`'s sources).
  """
  trainer = modern_step.TowerStep(plan, decay_steps, jit=config.jit)
  iterator = iter(inputs.distorted_inputs(config.data_dir, config.batch_size,
                                          config.num_gpus, seed=config.seed))
  device_of = graph_facts(trainer, iterator)
  for _ in range(warmup):
    trainer.next_step(iterator)
  wall_us = []
  with tf.profiler.experimental.Profile(config.train_dir):
    for k in range(steps):
      began = time.perf_counter()
      with tf.profiler.experimental.Trace(STEP_EVENT, step_num=k, _r=1):
        trainer.next_step(iterator)[0].numpy()  # the step ends when its result exists
      wall_us.append((time.perf_counter() - began) * 1e6)
  # The profile's one run: <train_dir>/plugins/profile/<run>/<host>.xplane.pb.
  with open(max(glob.glob(f'{config.train_dir}/plugins/profile/*/*.xplane.pb')), 'rb') as f:
    space = xplane_pb2.XSpace.FromString(f.read())
  logical_gpus = any(tf.config.get_logical_device_configuration(gpu)
                     for gpu in tf.config.list_physical_devices('GPU'))
  events, windows, sources = events_from_xspace(space, device_of, logical_gpus)
  return events, windows, wall_us, {'placement_sources': collections.Counter(sources.values())}
