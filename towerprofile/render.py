"""The outputs of a profile: Chrome-trace JSON, a PNG timeline, the report JSON."""

import json
import os

from cifar10_towers.towerprofile import analysis

# One colour per category (matplotlib's tab10 order); idle is not drawn.
COLOURS = {
    analysis.FORWARD: '#1f77b4',
    analysis.BACKWARD: '#ff7f0e',
    analysis.AVERAGE: '#2ca02c',
    analysis.UPDATE: '#d62728',
    analysis.EMA: '#9467bd',
    analysis.INPUT: '#8c564b',
    analysis.COPY: '#e377c2',
    analysis.OTHER: '#7f7f7f',
}


def chrome_trace(events):
  """A Chrome trace (Perfetto, chrome://tracing) of the events.

  One process per device, one thread per category, so a device's row shows
  what it spent its time on; every op is a complete ('X') event.

  Args:
    events: list of analysis.Event.

  Returns:
    dict, the JSON object format ({'traceEvents': [...]}).
  """
  device_list = sorted({e.device for e in events})
  origin = min((e.start_us for e in events), default=0.0)
  trace = []
  for pid, device in enumerate(device_list):
    trace.append({'ph': 'M', 'name': 'process_name', 'pid': pid, 'tid': 0,
                  'args': {'name': device}})
    for tid, category in enumerate(analysis.CATEGORIES):
      trace.append({'ph': 'M', 'name': 'thread_name', 'pid': pid, 'tid': tid,
                    'args': {'name': category}})
  for e in events:
    category = analysis.category_of(e)
    trace.append({
        'ph': 'X', 'name': e.name, 'cat': category,
        'pid': device_list.index(e.device),
        'tid': analysis.CATEGORIES.index(category),
        'ts': e.start_us - origin, 'dur': max(e.end_us - e.start_us, 0.0),
        'args': {'op_type': e.op_type, 'device': e.device, 'step': e.step},
    })
  return {'traceEvents': trace, 'displayTimeUnit': 'ms'}


def png_timeline(events, windows, report, path):
  """Draws one row per device, ops coloured by category; needs matplotlib.

  Args:
    events: list of analysis.Event.
    windows: list of (start_us, end_us) of the steps (drawn as dashed lines).
    report: the analysis report (title: its verdict).
    path: str, the PNG to write.

  Raises:
    ImportError: matplotlib is not installed.
  """
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  from matplotlib import patches  # pylint: disable=g-import-not-at-top
  from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
  device_list = sorted({e.device for e in events})
  origin = min((w[0] for w in windows), default=0.0)
  figure, axes = pyplot.subplots(figsize=(12, 1.0 + 0.7 * len(device_list)))
  for row, device in enumerate(device_list):
    by_category = {}
    for e in events:
      if e.device == device:
        by_category.setdefault(analysis.category_of(e), []).append(
            ((e.start_us - origin) / 1e3, (e.end_us - e.start_us) / 1e3))
    for category, bars in by_category.items():
      axes.broken_barh(bars, (row - 0.4, 0.8), facecolors=COLOURS[category],
                       linewidth=0)
  for start, end in windows:
    for edge in (start, end):
      axes.axvline((edge - origin) / 1e3, color='black', linestyle=':',
                   linewidth=0.6)
  axes.set_yticks(range(len(device_list)))
  axes.set_yticklabels(device_list)
  axes.invert_yaxis()
  axes.set_xlabel('ms')
  axes.set_title(report['verdict'], fontsize=9)
  axes.legend(handles=[patches.Patch(color=c, label=k)
                       for k, c in COLOURS.items()],
              loc='lower center', bbox_to_anchor=(0.5, 1.08), ncol=len(COLOURS),
              fontsize=8, frameon=False)
  figure.tight_layout()
  figure.savefig(path, dpi=100)
  pyplot.close(figure)


def write_all(events, windows, report, out_dir, warn=None):
  """Writes trace.json, report.json and timeline.png into out_dir.

  Args:
    events, windows, report: from an adapter and analysis.analyze.
    out_dir: str, created if missing.
    warn: callable(str) for the notice when matplotlib is missing.

  Returns:
    dict name -> path of what was written.
  """
  os.makedirs(out_dir, exist_ok=True)
  written = {}
  written['trace'] = os.path.join(out_dir, 'trace.json')
  with open(written['trace'], 'w') as f:
    json.dump(chrome_trace(events), f)
  written['report'] = os.path.join(out_dir, 'report.json')
  with open(written['report'], 'w') as f:
    json.dump(report, f, indent=1, sort_keys=True)
  try:
    path = os.path.join(out_dir, 'timeline.png')
    png_timeline(events, windows, report, path)
    written['png'] = path
  except ImportError:
    if warn:
      warn('matplotlib is not installed: no timeline.png '
           '(pip install matplotlib, or the [profile] extra).')
  return written


def format_report(report):
  """The report as lines for the terminal."""
  median = report['median']
  lines = ['%d tower(s); variables on %s; input on %s'
           % (report['num_towers'], report['variable_device'],
              report['input_device'])]
  lines.append('step %.1f ms (traced), %.1f ms (wall); step / slowest tower %s'
               % ((median['step_us'] or 0) / 1e3, (median['wall_us'] or 0) / 1e3,
                  '%.2f' % median['step_over_slowest_tower']
                  if median['step_over_slowest_tower'] else '-'))
  lines.append('median split of the step (idle: no op ran, e.g. the runtime '
               'dispatching):')
  step = median['step_us'] or 1.0
  for category, value in median['split_us'].items():
    lines.append('  %-15s %8.2f ms %5.1f%%' % (category, value / 1e3,
                                               100.0 * value / step))
  lines.append('busy fraction per device:')
  for device, value in median['busy_fraction'].items():
    lines.append('  %-15s %.2f' % (device, value))
  lines.append('placement:')
  for p in report['placement']:
    lines.append('  tower %d planned %s ran on %s%s' % (
        p['tower'], p['planned'],
        ', '.join('%s %.1f%%' % (d, 100 * s) for d, s in p['ran_on'].items()
                  if s >= 0.001) or 'nowhere (no compute traced)',
        '  MISPLACED' if p['misplaced'] else ''))
  lines.append('verdict: %s' % report['verdict'])
  return lines
