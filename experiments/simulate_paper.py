"""The paper's setting, modelled: Fig. 4's dispatch on 16 x 8 H100 and Fig. 3's rollout memory.

  python experiments/simulate_paper.py --out=runs/simulate_paper.json
  python experiments/simulate_paper.py --dispatch_json=runs/dispatch.json  # + our loopback rates

Nothing here runs on a GPU: the loopback machine cannot show the paper's bottleneck (one
controller NIC carrying every byte twice; on one machine every process shares the same memory
and cores), so this model carries the comparison with the paper's numbers.

Dispatch (Fig. 4). `--nodes` x `--gpus_per_node` workers, each holding `--payload_mib` of
reference log-probs per context length, every row moving to a worker of another layout, TCP
between and inside nodes (the paper: "TCP over Ethernet, identical to the baseline transport"),
`--nic_gbps` per node. Three ways:
  gather_scatter  the single controller (ROLL's driver path): N-1 blocks into the controller,
                  `--controller_streams` at a time (Ray pulls them concurrently) through its
                  NIC (those from its own node over loopback), the batch concatenated and
                  re-chunked by destination in its host memory (`--staging_copies` copies at
                  the host copy rate), N-1 blocks out again;
  allgather       every worker receives every other worker's block (multi-controller, no plan);
  layout_aware    every worker sends its rows straight to the workers that need them, all at
                  once: a worker's time is its own bytes at its stream rate, unless the node's
                  NIC, shared by its workers, is slower.
Every transfer pays the per-message latency. Parameters, and where each comes from:
  measured here   TCP stream rate and per-message latency between two local processes
                  (loopback), the host copy rate (numpy), at start-up (`--measure`, a few
                  seconds); with --dispatch_json, our layout_aware's per-process rate over
                  loopback as well (bytes each process sent / its time, from dispatch_latency);
  given           the cluster shape, the NIC rate and the payloads (the paper), the staging
                  copies (ROLL's driver concatenates the batch, then chunks it per worker);
  fitted          one: the per-worker stream rate at which the model gives the paper's 8K
                  ratio (the paper's EARL rate is not stated; its software path, not the wire,
                  sets it). The 16K and 32K ratios are then predictions.

Memory (Fig. 3). Qwen2.5-72B rollout engines at TP4 and TP8 on `--hbm_gib` GPUs, of which
`--usable_fraction` is for weights and K/V (vLLM's gpu_memory_utilization): weights per GPU and
K/V per token from the analytic memory model (`profiling/analytic.py`), hence each engine's K/V
capacity in tokens. A cell of #responses x context holds P = responses x context tokens at the
end of decoding. Predicted winner: TP4 while P fits in its K/V (decode is memory-bound and TP4
runs two engines on the GPUs of one TP8), TP8 once it does not (TP4 must preempt and recompute).
Predicted OOM: P above `--oom_ratio` x TP4's capacity (fitted: the paper's cells bracket it
between the largest P / capacity TP4 survived (64 x 32K) and the one it did not (128 x 32K); the
default is their geometric mean). Both are compared with the paper's cells.
"""

import json
import math
import os
import socket
import statistics
import threading
import time

import numpy as np
from absl import flags

from earl_jax import runtime
from earl_jax.errors import UserError

_NODES = flags.DEFINE_integer('nodes', 16, 'Nodes of the cluster.', lower_bound=1)
_GPN = flags.DEFINE_integer('gpus_per_node', 8, 'GPUs (workers) per node.', lower_bound=1)
_NIC = flags.DEFINE_float('nic_gbps', 200.0, 'NIC rate per node (Gbit/s).', lower_bound=1e-3)
_LENGTHS = flags.DEFINE_list('lengths', ['8192', '16384', '32768'], 'Fig. 4 context lengths.')
_PAYLOAD = flags.DEFINE_list('payload_mib', ['46', '93', '187'], 'Payload per worker (MiB).')
_STAGING = flags.DEFINE_integer(
  'staging_copies', 2, 'Host copies of the batch in the controller (concat + chunk).', lower_bound=0
)
_STREAMS = flags.DEFINE_integer(
  'controller_streams', 0, "The controller's concurrent transfers (0: every worker at once).",
  lower_bound=0,
)  # fmt: skip
_MEASURE = flags.DEFINE_bool('measure', True, 'Measure the loopback rates at start-up.')
_DISPATCH_JSON = flags.DEFINE_string(
  'dispatch_json', None, 'A dispatch_latency.py JSON: our layout_aware rate over loopback.'
)
_MODEL = flags.DEFINE_string('model', 'qwen2.5-72b', 'Model preset of the memory model.')
_TP = flags.DEFINE_list('tp', ['4', '8'], 'Tensor-parallel sizes of the two rollout engines.')
_HBM = flags.DEFINE_float('hbm_gib', 80.0, 'GPU memory (GiB).', lower_bound=1e-3)
_USABLE = flags.DEFINE_float(
  'usable_fraction', 0.9, 'Share of GPU memory for weights and K/V.', lower_bound=0.01,
  upper_bound=1.0,
)  # fmt: skip
_OOM_RATIO = flags.DEFINE_float(
  'oom_ratio', None, 'P / small-engine capacity above which it OOMs (default: fitted to the '
  "paper's cells).", lower_bound=1.0,
)  # fmt: skip
_OUT = flags.DEFINE_string('out', 'runs/simulate_paper.json', 'Results JSON.')

MiB = 1 << 20
PAPER_RATIOS = {8192: 9.7, 16384: 11.0, 32768: 11.2}
RESPONSES = (8, 16, 32, 64, 128)
CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768)
# Fig. 3 of the paper: Speedup%(TP4 -> TP8) per (context, responses); None = TP4 OOM.
PAPER_FIG3 = {
  32768: (-1.5, 4.6, 5.0, 6.5, None),
  16384: (-18.8, -5.0, 3.4, 5.5, 3.1),
  8192: (-24.7, -20.8, -4.4, 6.4, 5.2),
  4096: (-18.0, -25.2, -21.9, -5.9, 5.1),
  2048: (-20.0, -28.6, -26.3, -16.6, -5.5),
  1024: (-21.1, -32.2, -30.7, -29.1, -6.9),
}
# Defaults when --nomeasure (this machine, 2 cores, loopback; docs/results/paper-figures.md,
# "The paper's scale, modelled").
DEFAULT_RATES = {'tcp_bytes_per_s': 2.0e9, 'latency_s': 30e-6, 'copy_bytes_per_s': 5.0e9}


# ------------------------------------------------------------------------------ measurements


def _stream_server(port_box, ready, nbytes, reps):
  server = socket.socket()
  server.bind(('127.0.0.1', 0))
  server.listen(1)
  port_box.append(server.getsockname()[1])
  ready.set()
  conn, _ = server.accept()
  buf = memoryview(bytearray(nbytes))
  for _ in range(reps):
    got = 0
    while got < nbytes:
      got += conn.recv_into(buf[got:], nbytes - got)
    conn.sendall(b'k')
  for _ in range(200):  # ping-pong
    conn.recv(1)
    conn.sendall(b'p')
  conn.close()
  server.close()


def measure_rates(nbytes: int = 64 * MiB, reps: int = 5) -> dict:
  """TCP stream rate and per-message latency over loopback, and the host copy rate."""
  port_box, ready = [], threading.Event()
  # A thread is enough: the kernel's TCP path between two sockets is what is timed.
  t = threading.Thread(target=_stream_server, args=(port_box, ready, nbytes, reps), daemon=True)
  t.start()
  ready.wait(10)
  sock = socket.create_connection(('127.0.0.1', port_box[0]))
  sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
  payload = memoryview(np.ones(nbytes, np.uint8))
  rates = []
  for _ in range(reps):
    t0 = time.perf_counter()
    sock.sendall(payload)
    sock.recv(1)
    rates.append(nbytes / (time.perf_counter() - t0))
  rtts = []
  for _ in range(200):
    t0 = time.perf_counter()
    sock.sendall(b'p')
    sock.recv(1)
    rtts.append(time.perf_counter() - t0)
  sock.close()
  t.join(10)
  a = np.ones(256 * MiB // 8, np.float64)
  b = np.zeros_like(a)  # touched once: the copies below time the copy, not page faults
  copies = []
  for _ in range(5):
    t0 = time.perf_counter()
    np.copyto(b, a)
    copies.append(a.nbytes / (time.perf_counter() - t0))
  del a, b
  return {
    'tcp_bytes_per_s': statistics.median(rates),
    'latency_s': statistics.median(rtts) / 2,
    'copy_bytes_per_s': statistics.median(copies),
  }


def ours_from_dispatch_json(path: str) -> dict:
  """Our layout_aware's per-process rate over loopback: bytes each process sent / its time."""
  with open(path) as f:
    report = json.load(f)
  rates = []
  for r in report['results']:
    if 'layout_aware' in r['median_ms'] and 'socket_floor_bytes_per_process' in r:
      rates.append(r['socket_floor_bytes_per_process'] / (r['median_ms']['layout_aware'] / 1e3))
  if not rates:
    raise UserError(f'--dispatch_json {path}: expected a dispatch_latency.py result with '
                    'layout_aware and the socket floor')  # fmt: skip
  return {'layout_aware_bytes_per_s': statistics.median(rates), 'processes': report['processes']}


# ------------------------------------------------------------------------------ dispatch model


def dispatch_seconds(payload: float, rate: float, p: dict) -> dict[str, float]:
  """Modelled seconds of the three ways for `payload` bytes per worker (see the module doc).

  `rate` is one worker's stream rate (bytes/s); p holds nodes, gpn, nic (bytes/s), latency (s),
  copy (bytes/s), staging (copies), streams (the controller's concurrent transfers).
  """
  nodes, gpn, nic, lat = p['nodes'], p['gpn'], p['nic'], p['latency']
  n = nodes * gpn
  remote, local = n - gpn, gpn - 1  # the controller's peers off and on its node
  streams = max(1, min(p['streams'], n - 1))
  # Into the controller, `streams` transfers at a time (Ray pulls the workers' objects
  # concurrently): off-node bytes through its NIC, on-node ones over loopback, side by side.
  off = remote * payload / min(nic, min(streams, remote) * rate) if remote else 0.0
  on = local * payload / (min(streams, local) * rate) if local else 0.0
  wire = max(off, on) + math.ceil((n - 1) / streams) * lat
  staging = p['staging'] * n * payload / p['copy']
  gather_scatter = 2 * wire + staging  # in, the host copies, out again
  # Every worker receives n - 1 blocks; a node's NIC carries (n - gpn) blocks for each of its
  # gpn workers.
  allgather = max((n - 1) * payload / rate, gpn * remote * payload / nic) + (n - 1) * lat
  # Every worker sends its block to a worker on another node and receives one, all at once: its
  # own stream, or the node's NIC shared by its gpn workers.
  layout_aware = max(payload / rate, gpn * payload / nic if nodes > 1 else 0.0) + lat
  return {
    'gather_scatter': gather_scatter,
    'allgather': allgather,
    'layout_aware': layout_aware,
  }


def fit_rate(payload: float, target: float, p: dict) -> float:
  """The worker stream rate at which gather_scatter / layout_aware equals `target`: the ratio
  rises with the rate (the controller's host copies weigh more as the wire gets faster), from
  about 2 (a slow wire: each byte crosses twice) up to where the NIC binds (bisection)."""

  def ratio(r):
    t = dispatch_seconds(payload, r, p)
    return t['gather_scatter'] / t['layout_aware']

  lo, hi = 1e5, p['nic'] / p['gpn']
  if not ratio(lo) <= target <= ratio(hi):
    raise UserError(
      f'the model reaches gather_scatter / layout_aware = {ratio(lo):.1f}..{ratio(hi):.1f}x at '
      f'any worker rate; the target {target}x is outside it'
    )
  for _ in range(200):
    mid = math.sqrt(lo * hi)
    lo, hi = (mid, hi) if ratio(mid) < target else (lo, mid)
  return math.sqrt(lo * hi)


# ------------------------------------------------------------------------------ memory model


def memory_model(model_name: str, tps: list[int], hbm: float, usable: float, oom_ratio: float):
  from earl_jax.config import ModelConfig, ParallelConfig
  from earl_jax.profiling import analytic
  from earl_jax.sharding import mesh as mesh_lib

  try:
    model = ModelConfig.preset(model_name)
  except (KeyError, ValueError) as e:
    raise UserError(f'--model {model_name}: {e}') from None
  budget = int(hbm * usable * (1 << 30))
  engines = {}
  for tp in tps:
    pc = ParallelConfig(tp=tp)
    try:
      mesh_lib.check_model_fits(pc, model)
    except mesh_lib.ShardingError as e:
      raise UserError(f'--tp {tp}: {e}') from None
    weights = analytic.weight_bytes_per_device(model, pc)
    engines[tp] = {
      'weights_gib_per_gpu': weights / (1 << 30),
      'kv_capacity_tokens': analytic.kv_capacity_tokens(model, pc, budget),
    }
    if engines[tp]['kv_capacity_tokens'] <= 0:
      raise UserError(f'--tp {tp}: the weights ({weights / (1 << 30):.1f} GiB per GPU) do not '
                      f'fit {hbm * usable:.1f} GiB')  # fmt: skip
  small, large = min(tps), max(tps)
  cap = engines[small]['kv_capacity_tokens']
  # The paper's cells bracket the OOM threshold: above every P / capacity the small engine ran,
  # at or below the one it did not. Fitted: their geometric mean.
  ran = [
    r * c / cap for c, row in PAPER_FIG3.items() for r, v in zip(RESPONSES, row) if v is not None
  ]
  died = [r * c / cap for c, row in PAPER_FIG3.items() for r, v in zip(RESPONSES, row) if v is None]
  bracket = (max(ran), min(died))
  if oom_ratio is None:
    oom_ratio = math.sqrt(bracket[0] * bracket[1])
  cells, agree, oom_agree = [], 0, 0
  for ctx in CONTEXTS:
    for j, r in enumerate(RESPONSES):
      tokens = r * ctx
      oom = tokens > oom_ratio * cap
      winner = None if oom else (small if tokens <= cap else large)
      paper = PAPER_FIG3[ctx][j]
      paper_oom = paper is None
      paper_winner = None if paper_oom else (large if paper > 0 else small)
      agree += (not paper_oom) and winner == paper_winner
      oom_agree += oom == paper_oom
      cells.append({
        'context': ctx, 'responses': r, 'tokens': tokens, 'over_capacity': tokens / cap,
        'predicted': 'OOM' if oom else f'TP{winner}',
        'paper': 'OOM' if paper_oom else f'TP{paper_winner} ({paper:+.1f}%)',
      })  # fmt: skip
  return {
    'model': model_name,
    'budget_gib_per_gpu': budget / (1 << 30),
    'engines': {f'TP{k}': v for k, v in engines.items()},
    'oom_ratio': oom_ratio,
    'oom_bracket': bracket,
    'cells': cells,
    'winner_agrees': int(agree),
    'oom_agrees': int(oom_agree),
    'paper_cells': len(cells),
  }


# ------------------------------------------------------------------------------ main


def _floats(flag, name) -> list[float]:
  try:
    values = [float(x) for x in flag.value]
  except ValueError:
    raise UserError(f'--{name} {",".join(flag.value)}: expected numbers') from None
  if not values or min(values) <= 0:
    raise UserError(f'--{name} {",".join(flag.value)}: expected positive numbers')
  return values


def main(argv):
  del argv
  lengths = [int(x) for x in _floats(_LENGTHS, 'lengths')]
  payloads = _floats(_PAYLOAD, 'payload_mib')
  if len(payloads) != len(lengths):
    raise UserError(f'--payload_mib {",".join(_PAYLOAD.value)}: expected one value per '
                    f'--lengths entry ({len(lengths)})')  # fmt: skip
  tps = [int(x) for x in _floats(_TP, 'tp')]
  memory = memory_model(_MODEL.value, tps, _HBM.value, _USABLE.value, _OOM_RATIO.value)
  measured = measure_rates() if _MEASURE.value else dict(DEFAULT_RATES)
  ours = ours_from_dispatch_json(_DISPATCH_JSON.value) if _DISPATCH_JSON.value else None
  p = {
    'nodes': _NODES.value,
    'gpn': _GPN.value,
    'nic': _NIC.value * 1e9 / 8,
    'latency': measured['latency_s'],
    'copy': measured['copy_bytes_per_s'],
    'staging': _STAGING.value,
    'streams': _STREAMS.value or _NODES.value * _GPN.value - 1,
  }
  first = payloads[0] * MiB
  variants = {'tcp (measured stream rate)': measured['tcp_bytes_per_s']}
  if ours is not None:
    variants['ours (layout_aware over loopback)'] = ours['layout_aware_bytes_per_s']
  if lengths[0] in PAPER_RATIOS and _NODES.value * _GPN.value > 1:
    variants['fitted to the paper at 8K'] = fit_rate(first, PAPER_RATIOS[lengths[0]], p)
  dispatch = []
  for name, rate in variants.items():
    rows = []
    for T, mib in zip(lengths, payloads):
      t = dispatch_seconds(mib * MiB, rate, p)
      paper = PAPER_RATIOS.get(T)
      ratio = t['gather_scatter'] / t['layout_aware']
      rows.append({
        'context': T, 'payload_mib': mib, 'seconds': t, 'ratio': ratio,
        'allgather_ratio': t['allgather'] / t['layout_aware'],
        'paper_ratio': paper,
        'within_15pct': None if paper is None else abs(ratio / paper - 1) <= 0.15,
      })  # fmt: skip
    dispatch.append({'variant': name, 'worker_rate_bytes_per_s': rate, 'rows': rows})
  report = {
    'experiment': 'simulate_paper',
    'cluster': {'nodes': _NODES.value, 'gpus_per_node': _GPN.value, 'nic_gbps': _NIC.value},
    'measured': measured,
    'ours_loopback': ours,
    'parameters': {**p, 'fitted': ['worker rate (variant "fitted")', 'oom_ratio']},
    'dispatch': dispatch,
    'memory': memory,
  }
  _print(report)
  os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
  with open(_OUT.value, 'w') as f:
    json.dump(report, f, indent=1)
  print(f'wrote {_OUT.value}')


def _print(r: dict) -> None:
  m, c = r['measured'], r['cluster']
  print(f'Dispatch, {c["nodes"]} x {c["gpus_per_node"]} workers, {c["nic_gbps"]:.0f} Gbit/s per '
        f'node; measured here: TCP stream {m["tcp_bytes_per_s"] / 1e9:.2f} GB/s, latency '
        f'{m["latency_s"] * 1e6:.0f} us, host copy {m["copy_bytes_per_s"] / 1e9:.2f} GB/s')  # fmt: skip
  for v in r['dispatch']:
    print(f'\n  worker rate {v["worker_rate_bytes_per_s"] / 1e9:.3f} GB/s: {v["variant"]}')
    print(f'  {"context":>8} {"gather_scatter s":>16} {"allgather s":>11} {"layout_aware s":>14} '
          f'{"gs/la":>7} {"paper":>6} {"within 15%":>10}')  # fmt: skip
    for x in v['rows']:
      s = x['seconds']
      paper = '-' if x['paper_ratio'] is None else f'{x["paper_ratio"]:.1f}x'
      ok = '-' if x['within_15pct'] is None else ('yes' if x['within_15pct'] else 'no')
      print(f'  {x["context"] // 1024:>7}K {s["gather_scatter"]:16.3f} {s["allgather"]:11.3f} '
            f'{s["layout_aware"]:14.4f} {x["ratio"]:6.1f}x {paper:>6} {ok:>10}')  # fmt: skip
  mem = r['memory']
  print(f'\nRollout memory, {mem["model"]}, {mem["budget_gib_per_gpu"]:.1f} GiB per GPU for weights '
        'and K/V:')  # fmt: skip
  for name, e in mem['engines'].items():
    print(f'  {name}: weights {e["weights_gib_per_gpu"]:.1f} GiB per GPU, K/V capacity '
          f'{e["kv_capacity_tokens"] / 1e6:.2f}M tokens per engine')  # fmt: skip
  lo, hi = mem['oom_bracket']
  print(f'  predicted (paper) per context x responses; OOM above {mem["oom_ratio"]:.1f} x the small '
        f"engine's capacity (fitted; the paper's cells put it in ({lo:.1f}, {hi:.1f}]):")  # fmt: skip
  for ctx in CONTEXTS[::-1]:
    cells = [x for x in mem['cells'] if x['context'] == ctx]
    print(f'  {ctx // 1024:>3}K ' + ' '.join(f'{x["predicted"]:>5} ({x["paper"].split()[0]:>4})'
                                             for x in cells))  # fmt: skip
  print(f'  winner agrees with the paper in {mem["winner_agrees"]} of 29 cells; OOM in '
        f'{mem["oom_agrees"]} of {mem["paper_cells"]}')  # fmt: skip


if __name__ == '__main__':
  runtime.run(main)
