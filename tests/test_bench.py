"""bench: the measurement plan, the arithmetic of the report, and one tiny real run.

No assertion here is about speed: the machine is shared and noisy. The tests
check what is measured, in which order, and that every ratio is computed from
the measured numbers.
"""

import functools
import json
import logging
import os
import re
import statistics
import sys

import pytest
from click.testing import CliRunner

from cifar10_towers import bench
from cifar10_towers import cli

import bench_contender
import faults_support as fs

# conv1 24x24x(5x5x3)x64, conv2 12x12x(5x5x64)x64, local3, local4, softmax_linear.
CONV1_FLOPS = 2 * 24 * 24 * 75 * 64
FORWARD_FLOPS = CONV1_FLOPS + 2 * (12 * 12 * 1600 * 64 + 2304 * 384 + 384 * 192 +
                                   192 * 10)


def test_flops_per_image_follow_the_layer_table():
  assert sum(bench.layer_flops_per_image()) == FORWARD_FLOPS == 36941568
  assert bench.layer_flops_per_image()[0] == CONV1_FLOPS
  # Forward, weight gradients, and input gradients of every layer but conv1
  # (the images need none): ~105.3 MFLOP, not forward x 3 (~110.8).
  assert bench.training_flops_per_image() == 3 * FORWARD_FLOPS - CONV1_FLOPS == 105295104


class FakeContender:
  """Stands in for a contender process: known window times per (contender, round)."""

  # Rates drift a lot from round to round (rounds -1 and -2 are warm-up).
  RATES = {'keras': [100.0, 200.0, 400.0], 'legacy': [300.0, 200.0, 400.0],
           'modern': [130.0, 300.0, 600.0]}
  CPU_CORES = 1.6  # CPU seconds per wall second of every window
  # A trainer's (summary step, save) costs in ms, the same in every window:
  # legacy's none, so that its cadence img/s are its img/s.
  COSTS = {'legacy': (0.0, 0.0), 'modern': (450.0, 300.0)}

  @classmethod
  def extra_seconds(cls, impl, window_steps):
    """What a window's costs add at the default cadence (a summary / 100 steps, a save / 1000)."""
    summary_ms, save_ms = cls.COSTS.get(impl, (0.0, 0.0))
    return window_steps * (summary_ms / 100 + save_ms / 1000) / 1000

  def __init__(self, spec, log):
    assert spec['timeout_secs'] > 0
    self.spec = spec
    self._log = log
    self._windows = 0
    self.killed = False

  def read(self):
    if self.spec['kind'] == 'input':  # unpaced: its result at once
      rate = 5000.0 if self.spec['impl'] == 'legacy' else 9000.0
      return {'window_images_per_sec': [rate - 10, rate, rate + 10],
              'peak_rss_bytes': 2 ** 29}
    self._log.append(('ready', self.spec['impl'], self.spec.get('num_gpus')))
    return {}

  def window(self):
    if self._windows == self.spec['windows'] == 5:  # after the last window: the result
      return {'peak_rss_bytes': (3 if self.spec['impl'] == 'modern' else 2) * 2 ** 28}
    r = self._windows - 2  # 2 warm-up rounds
    self._windows += 1
    self._log.append(('window', self.spec['impl'], self.spec.get('num_gpus'), r))
    if self.spec['kind'] == 'matmul':  # the best of all rounds: warm-up round 1
      return {'flops_per_sec': 2.2e11 if r == -1 else 2e11 - r * 1e10,
              'seconds': 1.0, 'cpu_seconds': 1.6}
    rate = self.RATES[self.spec['impl']][max(r, 0)] * (
        1.5 if self.spec['num_gpus'] == 2 else 1.0)
    images = self.spec['window_steps'] * self.spec['batch_size'] * self.spec['num_gpus']
    window = {'seconds': images / rate, 'cpu_seconds': images / rate * self.CPU_CORES}
    if self.spec['impl'] in self.COSTS:  # as bench._window_figures reports them
      summary_ms, save_ms = self.COSTS[self.spec['impl']]
      window.update(costs={'summary_ms': summary_ms, 'save_ms': save_ms},
                    cadence_seconds=images / rate + self.extra_seconds(
                        self.spec['impl'], self.spec['window_steps']))
    return window

  def kill(self):
    self.killed = True


class Messages(logging.Handler):
  """What a logger said at INFO and above."""

  def __init__(self, logger):
    super().__init__(logging.INFO)
    self.logger, self.messages, self.level_before = logger, [], logger.level

  def emit(self, record):
    self.messages.append(record.getMessage())

  def __enter__(self):
    self.logger.addHandler(self)
    self.logger.setLevel(logging.INFO)
    return self.messages

  def __exit__(self, *exc_info):
    self.logger.removeHandler(self)
    self.logger.setLevel(self.level_before)


@pytest.fixture(scope='module')
def fake_report(synth_data_dir):
  log, launched = [], []

  def launch(spec):
    launched.append(FakeContender(spec, log))
    return launched[-1]

  config = bench.BenchConfig(num_gpus=(1, 2), batch_size=8, data_dir=synth_data_dir,
                             rounds=3, warmup_rounds=2, window_steps=10)
  with Messages(bench.logger) as messages:
    report = bench.run(config, launch=launch)
  return report, log, messages, launched


def test_contenders_take_turns_window_by_window(fake_report):
  _, log, messages, launched = fake_report
  contenders = [('keras', 1), ('legacy', 1), ('modern', 1), ('keras', 2),
                ('legacy', 2), ('modern', 2), ('matmul', None)]
  assert log[:7] == [('ready',) + c for c in contenders]
  windows = [entry[1:] for entry in log[7:]]
  assert len(windows) == 5 * 7
  for r in range(5):  # each round: every contender once, the order rotated by r
    order = contenders[r % 7:] + contenders[:r % 7]
    assert windows[7 * r:7 * (r + 1)] == [c + (r - 2,) for c in order]
  assert all(c.killed for c in launched)  # none outlives the run
  assert messages[0].startswith('Starting 7 contenders, one process each')
  # While they start (seconds each), a line as each is ready.
  assert [(m.startswith('Ready: '), m.rsplit(' (', 1)[-1]) for m in messages[1:8]] == [
      (True, '%d of 7)' % i) for i in range(1, 8)]
  assert 'Ready: keras, 1 tower(s) x batch 8' in messages[1]
  assert '[warm-up 1/2] measuring keras, 1 tower(s) x batch 8' in messages[8]
  assert '[round 3/3] measuring' in messages[-5]
  assert messages[-4:] == ['[inputs] measuring %s, %d tower(s) x batch 8: input '
                           'pipeline alone' % (impl, n)
                           for n in (1, 2) for impl in ('legacy', 'modern')]


def cadence_rates(impl, num_gpus):
  """FakeContender's per-round img/s of `impl` at the default cadence (fake_report's settings)."""
  images = 10 * 8 * num_gpus
  scale = 1.5 if num_gpus == 2 else 1.0
  return [images / (images / (rate * scale) + FakeContender.extra_seconds(impl, 10))
          for rate in FakeContender.RATES[impl]]


def test_ratios_are_medians_of_per_round_ratios(fake_report):
  report, _, _, _ = fake_report
  rates = FakeContender.RATES
  estimate = 2.2e11 / bench.training_flops_per_image()
  assert report['machine']['matmul_flops_per_sec'] == 2.2e11
  assert report['machine']['matmul_estimate_images_per_sec'] == pytest.approx(estimate)
  rows = {(row['impl'], row['num_gpus']): row for row in report['rows']}
  assert list(rows) == [(i, n) for n in (1, 2) for i in ('keras', 'legacy', 'modern')]
  for impl in ('keras', 'legacy', 'modern'):
    for n, scale in ((1, 1.0), (2, 1.5)):
      # The ratios are of img/s at the default cadence (Keras': its img/s).
      cadence = cadence_rates(impl, n)
      per_round = [a / b for a, b in zip(cadence, cadence_rates('keras', n))]
      row = rows[(impl, n)]
      rate = statistics.median(rates[impl]) * scale
      assert row['images_per_sec'] == pytest.approx(rate)
      assert row['cadence_images_per_sec'] == pytest.approx(statistics.median(cadence))
      assert [r['cadence_images_per_sec'] for r in row['rounds']] == pytest.approx(cadence)
      assert row['images_per_cpu_second'] == pytest.approx(rate / FakeContender.CPU_CORES)
      assert row['ratio_to_baseline'] == pytest.approx(statistics.median(per_round))
      assert [r['ratio_to_baseline'] for r in row['rounds']] == pytest.approx(per_round)
      assert row['ratio_to_matmul_estimate'] == pytest.approx(
          statistics.median(cadence) / estimate)
      assert row['ratio_to_1_tower'] == pytest.approx(statistics.median(
          [a / b for a, b in zip(cadence, cadence_rates(impl, 1))]))
      assert row['window_min'] == pytest.approx(min(rates[impl]) * scale)
      assert row['window_max'] == pytest.approx(max(rates[impl]) * scale)
      assert row['peak_rss_bytes'] == (3 if impl == 'modern' else 2) * 2 ** 28
      if impl == 'keras':
        assert row['input_images_per_sec'] is None
        assert 'summary_ms' not in row and 'save_ms' not in row  # it writes neither
      else:
        expected_input = 5000.0 if impl == 'legacy' else 9000.0
        assert row['input_images_per_sec'] == expected_input
        assert row['input_to_training'] == pytest.approx(expected_input / rate)
        summary_ms, save_ms = FakeContender.COSTS[impl]
        assert (row['summary_ms'], row['save_ms']) == (summary_ms, save_ms)
        assert [(r['summary_ms'], r['save_ms']) for r in row['rounds']] == [
            (summary_ms, save_ms)] * 3
  # The median of the per-round ratios, not the ratio of the medians: legacy's
  # rounds are 3.0, 1.0 and 1.0 times the baseline's, its median rate 1.5x.
  assert rows[('legacy', 1)]['ratio_to_baseline'] == pytest.approx(1.0)
  assert (rows[('legacy', 1)]['images_per_sec'] / rows[('keras', 1)]['images_per_sec']
          == pytest.approx(1.5))
  # Modern: 1.5x Keras in plain img/s, less once its summary steps and saves count.
  assert statistics.median(a / b for a, b in zip(rates['modern'], rates['keras'])) == 1.5
  assert rows[('modern', 1)]['ratio_to_baseline'] == pytest.approx(
      80 / (80 / 130 + 0.048) / 100)  # round 1: 130 img/s plain; 0.048 s per 10 steps


def test_table_shows_every_row_with_its_ratios(fake_report):
  report, _, _, _ = fake_report
  table = bench.format_table(report)
  lines = table.splitlines()
  assert lines[0].startswith('matmul estimate: best of 5 rounds of fp32 4096x4096 '
                             'matmuls = 220.0 GFLOP/s / 105.3 MFLOP')
  assert lines[0].endswith('(a sample under the same load, not a bound)')
  header = [l for l in lines if l.startswith('impl')][0]
  for column in ('img/s', 'summary ms', 'save ms', 'cadence img/s', 'img/cpu-s', 'vs keras',
                 'vs matmul', 'vs 1 tower', 'input/train', 'peak RSS MiB'):
    assert column in header
  modern_2 = [l.split() for l in lines if l.startswith('modern') and l.split()[1] == '2']
  row = [r for r in report['rows'] if (r['impl'], r['num_gpus']) == ('modern', 2)][0]
  assert modern_2 == [['modern', '2', '8', '450', '195-900', '450', '300',
                       '%.0f' % row['cadence_images_per_sec'], '281',
                       '%.2fx' % row['ratio_to_baseline'],
                       '%.2f' % (row['cadence_images_per_sec'] /
                                 report['machine']['matmul_estimate_images_per_sec']),
                       '%.2fx' % row['ratio_to_1_tower'], '9000', '20.0x', '768']]
  assert '%.0f' % row['cadence_images_per_sec'] == '396'  # 160 / (160 / 450 + 0.048)
  keras_1 = [l.split() for l in lines if l.startswith('keras') and l.split()[1] == '1'][0]
  assert keras_1[3] == '200' and keras_1[5:8] == ['-', '-', '200']  # its cadence img/s: its img/s
  assert ('cadence img/s, which the ratios use: with a summary step every 100 and a save '
          'every 1000 steps') in table


class FakeClocks:
  """Stands in for bench's `time`: wall and CPU clocks that only `spend` moves."""

  def __init__(self):
    self.wall = self.cpu = 0.0

  def perf_counter(self):
    return self.wall

  def process_time(self):
    return self.cpu

  def spend(self, seconds):
    self.wall += seconds
    self.cpu += 1.5 * seconds  # 1.5 cores busy


@pytest.mark.parametrize('window_steps, windows, boundaries', [
    (10, 3, [16, 30, 44, 58]), (1, 2, [8, 14, 20])])
@pytest.mark.parametrize('on_step_first', [True, False])
def test_a_trainers_windows_hold_plain_steps_a_summary_and_saves_timed_apart(
    monkeypatch, tmp_path, on_step_first, window_steps, windows, boundaries):
  """contend_training through a fake trainer's loop, with fake clocks.

  Each step takes 0.1 s; a summary step 0.4 s more in the step and 0.05 s to
  write after it, a save 0.3 s after the step. The loop calls `on_step`
  before the writing and the save (runtime.training.train_loop's order), or
  after them: the figures are the same.
  """
  from cifar10_towers.modern import train as modern_train  # pylint: disable=import-outside-toplevel
  clocks, seen, steps = FakeClocks(), [], []
  monkeypatch.setattr(bench, 'time', clocks)

  def train(config, plan, on_step):
    del plan
    for step in range(1, config.max_steps + 1):
      summary = step % config.summary_every == 0
      clocks.spend(0.1 + 0.4 * summary)  # the step, computing its summaries
      if on_step_first:
        on_step(step, 0.1, 8)
      clocks.spend(0.05 * summary + 0.3 * (step % config.save_every == 0))  # write, save
      if not on_step_first:
        on_step(step, 0.1, 8)
      steps.append(step)

  def boundary(**figures):
    seen.append((steps[-1] + 1, figures))  # (the step of this on_step, ...)
    clocks.spend(5.0)  # the wait for the parent's go: in no window

  monkeypatch.setattr(modern_train, 'train', train)
  spec = {'impl': 'modern', 'num_gpus': 1, 'batch_size': 8, 'data_dir': str(tmp_path),
          'windows': windows, 'window_steps': window_steps, 'jit': False,
          'scratch': str(tmp_path)}
  bench.contend_training(spec, boundary)
  # 10 steps: windows of 14 steps, 10 plain, a save at step 7, a summary step and
  # a save at step 14; 1 step: windows of 6 steps, 2 plain, saves at steps 3 and 6.
  # The ready boundary after the first summary step, then one per window.
  assert [step for step, _ in seen] == boundaries and steps[-1] == boundaries[-1]
  for _, figures in seen[1:]:
    assert figures['seconds'] == pytest.approx(window_steps * 0.1, rel=1e-9)  # plain steps
    assert figures['cpu_seconds'] == pytest.approx(window_steps * 0.15, rel=1e-9)
    assert figures['costs'] == {'summary_ms': pytest.approx(450, rel=1e-9),
                                'save_ms': pytest.approx(300, rel=1e-9)}
    # At the default cadence: window_steps x (0.1 + 0.45 / 100 + 0.3 / 1000) s.
    assert figures['cadence_seconds'] == pytest.approx(window_steps * 0.1048, rel=1e-9)


def test_a_report_from_before_the_costs_reads_back_saying_what_it_lacks(tmp_path):
  """Reports written before the costs were measured (docs/bench.json among them)."""
  report = synthetic_report()
  for row in report['rows']:
    for record in [row] + row['rounds']:
      for key in ('cadence_images_per_sec', 'summary_ms', 'save_ms'):
        record.pop(key, None)
  path = tmp_path / 'old.json'
  path.write_text(json.dumps(report))
  result = CliRunner().invoke(cli.cli, ['bench', '--from_json', str(path)])
  assert result.exit_code == 0, result.output
  assert ('summary ms, save ms, cadence img/s: not measured (the report predates them): img/s '
          'and ratios are of whole windows') in result.output
  rows = [l.split() for l in result.output.splitlines() if l.startswith(('legacy', 'modern'))]
  assert len(rows) == 4 and all(row[5:8] == ['-', '-', '-'] for row in rows)
  result = CliRunner().invoke(cli.cli, ['bench', '--from_json', os.path.join(
      fs.ROOT, 'docs', 'bench.json')])
  assert result.exit_code == 0 and 'not measured (the report predates them)' in result.output


@pytest.mark.slow
def test_a_failing_contender_is_a_bench_error(tmp_path):
  spec = {'kind': 'no-such-measurement', 'impl': 'modern', 'num_gpus': 1,
          'batch_size': 8, 'scratch': str(tmp_path), 'timeout_secs': 120}
  contender = bench.Contender(spec)
  with pytest.raises(bench.BenchError,
                     match=r'modern, 1 tower.*failed \(exit 1\).*KeyError'):
    contender.read()


@pytest.mark.parametrize('args, message', [
    (['--impl', 'legacy,tf1'], "'tf1' is not one of 'legacy', 'modern'"),
    (['--num_gpus', '1,0'], "'--num_gpus': 0 is not in the range 1<=x<=64"),
    (['--num_gpus', 'two'], "'--num_gpus': 'two' is not a valid integer"),
    (['--rounds', '0'], "0 is not in the range x>=1"),
    (['--warmup_rounds', '-1'], "-1 is not in the range x>=0"),
])
def test_bench_command_refuses_bad_lists(args, message):
  result = CliRunner().invoke(cli.cli, ['bench'] + args)
  assert result.exit_code == 2
  assert message in result.output


@pytest.mark.slow
def test_bench_command_measures_and_writes_json(synth_data_dir, tmp_path, monkeypatch):
  """A tiny real run: every contender in its own process (forked by the fork
  server: tests/bench_contender.py); table and JSON agree."""
  monkeypatch.setattr(bench, 'run', functools.partial(
      bench.run, launch=bench_contender.forked_contender()))
  path = tmp_path / 'bench.json'
  with Messages(bench.logger) as messages:
    result = CliRunner().invoke(cli.cli, [
        'bench', '--impl', 'legacy,modern', '--num_gpus', '1', '--batch_size', '8',
        '--rounds', '2', '--warmup_rounds', '0', '--window_steps', '2',
        '--matmul_size', '256', '--data_dir', synth_data_dir, '--json', str(path)])
  assert result.exit_code == 0, result.output
  assert ('[round 2/2] measuring legacy, 1 tower(s) x batch 8: training, 2 steps'
          in messages)
  report = json.loads(path.read_text())
  machine = report['machine']
  assert len(machine['matmul_runs_flops_per_sec']) == 2  # one per round
  assert machine['matmul_flops_per_sec'] == max(machine['matmul_runs_flops_per_sec']) > 0
  assert machine['matmul_estimate_images_per_sec'] == pytest.approx(
      machine['matmul_flops_per_sec'] / machine['training_flops_per_image'])
  rows = {row['impl']: row for row in report['rows']}
  assert set(rows) == {'keras', 'legacy', 'modern'}
  baseline_by_round = [r['images_per_sec'] for r in rows['keras']['rounds']]
  for impl, row in rows.items():
    rounds = row['rounds']
    assert [r['round'] for r in rounds] == [0, 1]
    rates = [r['images_per_sec'] for r in rounds]
    cadence = [r['cadence_images_per_sec'] for r in rounds]
    assert min(rates) > 0 and min(r['images_per_cpu_second'] for r in rounds) > 0
    assert [r['baseline_images_per_sec'] for r in rounds] == baseline_by_round
    # Every figure comes from the measured windows; the ratios from cadence img/s.
    assert row['images_per_sec'] == pytest.approx(statistics.median(rates))
    assert row['ratio_to_baseline'] == pytest.approx(statistics.median(
        [a / b for a, b in zip(cadence, baseline_by_round)]))
    assert row['ratio_to_matmul_estimate'] == pytest.approx(
        row['cadence_images_per_sec'] / machine['matmul_estimate_images_per_sec'])
    assert row['peak_rss_bytes'] > 100 * 2 ** 20
    line = [l for l in result.output.splitlines() if l.startswith(impl + ' ')][0]
    assert line.split()[3] == '%.0f' % row['images_per_sec']
    assert line.split()[9] == '%.2fx' % row['ratio_to_baseline']
    if impl == 'keras':
      assert cadence == rates and line.split()[5:7] == ['-', '-']
    else:
      # Each round's cadence img/s: 2 steps of 8 images at its plain rate,
      # plus 2 steps' share of a summary step per 100 and a save per 1000.
      assert cadence == pytest.approx([16 / (16 / r['images_per_sec'] + 2 * (
          r['summary_ms'] / 100 + r['save_ms'] / 1000) / 1000) for r in rounds])
      assert line.split()[5:7] == ['%.0f' % row['summary_ms'], '%.0f' % row['save_ms']]
    if impl != 'keras':
      assert len(row['input_window_images_per_sec']) == bench.INPUT_WINDOWS
      assert row['input_images_per_sec'] == pytest.approx(
          statistics.median(row['input_window_images_per_sec']))
      assert row['input_to_training'] == pytest.approx(
          row['input_images_per_sec'] / row['images_per_sec'])


# --- the plot ------------------------------------------------------------------

PNG_SIGNATURE = b'\x89PNG\r\n\x1a\n'


def synthetic_report():
  """A small report from `summarize` over made-up windows (nothing is run)."""
  config = bench.BenchConfig(num_gpus=(1, 2), batch_size=8, rounds=3,
                             warmup_rounds=0, window_steps=10)
  rates = {'keras': [100.0, 120.0, 110.0], 'legacy': [130.0, 90.0, 140.0],
           'modern': [125.0, 135.0, 120.0]}
  windows, finals = {}, {}
  for n in (1, 2):
    for impl, per_round in rates.items():
      windows[(impl, n)] = [
          {'round': r, 'seconds': 10 * 8 * n / (rate * n), 'cpu_seconds': 1.0}
          for r, rate in enumerate(per_round)]
      finals[(impl, n)] = {'peak_rss_bytes': 2 ** 28}
  windows[(bench.MATMUL, None)] = [{'flops_per_sec': 1e10} for _ in range(3)]
  inputs = {(impl, n): {'window_images_per_sec': [1000.0], 'peak_rss_bytes': 2 ** 28}
            for n in (1, 2) for impl in ('legacy', 'modern')}
  return bench.summarize(config, windows, finals, inputs, 'made up')


@pytest.fixture
def results_json(tmp_path):
  path = tmp_path / 'results.json'
  bench.write_json(synthetic_report(), str(path))
  return path


def test_plot_draws_a_png_from_a_json_file_without_measuring(results_json, tmp_path):
  pytest.importorskip('matplotlib')
  png = tmp_path / 'bench.png'
  result = CliRunner().invoke(cli.cli, ['bench', '--from_json', str(results_json),
                                        '--plot', str(png)])
  assert result.exit_code == 0, result.output
  assert 'Starting' not in result.output and 'measuring' not in result.output
  modern_2 = [l.split() for l in result.output.splitlines()
              if l.startswith('modern') and l.split()[1] == '2'][0]
  assert modern_2[3] == '250' and modern_2[9] == '%.2fx' % [
      r['ratio_to_baseline'] for r in synthetic_report()['rows']
      if (r['impl'], r['num_gpus']) == ('modern', 2)][0]  # the file's table
  assert result.output.rstrip().endswith('Wrote %s.' % png)
  data = png.read_bytes()
  assert data.startswith(PNG_SIGNATURE) and len(data) > 10000


def test_plot_without_matplotlib_is_a_one_line_error(results_json, tmp_path,
                                                     monkeypatch):
  for name in [m for m in sys.modules if m.split('.')[0] == 'matplotlib']:
    monkeypatch.delitem(sys.modules, name)
  monkeypatch.setitem(sys.modules, 'matplotlib', None)  # import raises ImportError
  png = tmp_path / 'bench.png'
  with pytest.raises(bench.BenchError, match='pip install matplotlib'):
    bench.plot(synthetic_report(), str(png))
  result = CliRunner().invoke(cli.cli, ['bench', '--from_json', str(results_json),
                                        '--plot', str(png)])
  assert result.exit_code == 1
  error = [l for l in result.output.splitlines() if l.startswith('Error:')]
  assert error == ['Error: ' + bench.MATPLOTLIB_HINT + '.'] or error == [
      'Error: ' + bench.MATPLOTLIB_HINT]
  assert 'Traceback' not in result.output and not png.exists()
  # A measuring run with --plot fails before it measures anything.
  result = CliRunner().invoke(cli.cli, ['bench', '--num_gpus', '1', '--plot', str(png)])
  assert result.exit_code == 1 and 'pip install matplotlib' in result.output
  assert 'Generating' not in result.output and 'Starting' not in result.output


@pytest.mark.parametrize('args, message', [
    (['--rounds', '3'], '--from_json draws results measured earlier; it takes only '
                        '--plot, not --rounds.'),
    (['--json', 'x.json', '--jit'], 'not --json, --jit.'),
])
def test_from_json_refuses_measurement_options(results_json, args, message):
  result = CliRunner().invoke(cli.cli, ['bench', '--from_json', str(results_json)] + args)
  assert result.exit_code == 2 and message in result.output


def test_from_json_refuses_a_file_that_is_no_bench_report(tmp_path):
  path = tmp_path / 'other.json'
  path.write_text('{"rows": []}')
  result = CliRunner().invoke(cli.cli, ['bench', '--from_json', str(path)])
  assert result.exit_code == 1
  assert 'is not a bench results file (one written by bench --json)' in result.output


# Words by which a line's label claims that no measured rate can lie above it.
BOUND_WORDS = re.compile(r'ceiling|bound|limit|maximum|peak|roofline|at most|cannot',
                         re.I)


def labelled_lines(report):
  """(height, label) of every horizontal line with a legend label in the plot."""
  axes = bench.figure(report).axes[0]
  lines = []
  for line in axes.get_lines():
    heights = set(line.get_ydata())
    if not line.get_label().startswith('_') and len(heights) == 1:
      lines.append((heights.pop(), line.get_label()))
  return lines


def bounds_under_rates(report, lines):
  """The lines labelled a bound that some measured window (an error bar's top) exceeds."""
  highest = max(row['window_max'] for row in report['rows'])
  return [(height, label) for height, label in lines
          if BOUND_WORDS.search(label) and height < highest]


def test_the_old_ceiling_label_would_be_caught():
  """The check below fails on the plot as it was: 'machine ceiling' at 504 under 583."""
  report = bench.read_json(os.path.join(fs.ROOT, 'docs', 'bench.json'))
  old = (504.1, 'machine ceiling (best matmul rate / FLOPs per image): 504')
  assert bounds_under_rates(report, [old]) == [old]
  assert bounds_under_rates(report, [(600.0, old[1])]) == []


@pytest.mark.parametrize('source', ['docs/bench.json', 'bench --json'])
def test_no_line_labelled_a_bound_lies_under_a_measured_rate(source, results_json):
  """Drawn from what --from_json reads: the committed run and a --json file.

  The matmul estimate is a sample under the same load as the windows, and
  real windows beat it (docs/bench.json: modern's 2-tower window of 583
  img/s over 531), so its label must not call it a bound; the made-up
  report's windows beat its estimate too.
  """
  pytest.importorskip('matplotlib')
  path = (os.path.join(fs.ROOT, 'docs', 'bench.json') if source == 'docs/bench.json'
          else str(results_json))
  report = bench.read_json(path)
  machine = report['machine']
  lines = labelled_lines(report)
  assert bounds_under_rates(report, lines) == []
  (estimate,) = [label for height, label in lines
                 if height == pytest.approx(machine['matmul_estimate_images_per_sec'])]
  # The line says how it was measured, with the figures it came from.
  assert estimate.startswith('matmul estimate %.0f = best fp32 4096x4096 matmul rate, '
                             % machine['matmul_estimate_images_per_sec'])
  assert '%.1f GFLOP/s, / 105.3 MFLOP per training image' % (
      machine['matmul_flops_per_sec'] / 1e9) in estimate
  assert not BOUND_WORDS.search(estimate)


def test_an_older_report_reads_back_with_todays_names(results_json, tmp_path):
  """A --json file written while the estimate was a 'ceiling' of forward x 3 FLOPs."""
  report = json.loads(results_json.read_text())
  machine = report['machine']
  old_flops = 3 * sum(bench.layer_flops_per_image())
  machine['training_flops_per_image'] = old_flops
  machine['ceiling_images_per_sec'] = machine.pop('matmul_estimate_images_per_sec')
  for row in report['rows']:
    row['ratio_to_ceiling'] = row.pop('ratio_to_matmul_estimate')
  path = tmp_path / 'old.json'
  path.write_text(json.dumps(report))
  upgraded = bench.read_json(str(path))
  machine = upgraded['machine']
  estimate = 1e10 / bench.training_flops_per_image()  # synthetic_report's matmul
  assert 'ceiling_images_per_sec' not in machine
  assert machine['training_flops_per_image'] == bench.training_flops_per_image()
  assert machine['matmul_estimate_images_per_sec'] == pytest.approx(estimate)
  for row in upgraded['rows']:
    assert 'ratio_to_ceiling' not in row
    assert row['ratio_to_matmul_estimate'] == pytest.approx(
        row['images_per_sec'] / estimate)
  assert bench.format_table(upgraded) == bench.format_table(synthetic_report())
