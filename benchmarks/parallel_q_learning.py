"""The speed story of parallel_q_learning.py, measured side by side in one run.

    .venv/bin/python benchmarks/parallel_q_learning.py      # from the repository root
    .venv/bin/python benchmarks/parallel_q_learning.py --max-agents 4 --agent-steps 4000 \
        --numpy-steps 200 --repeats 1 --yardstick-timesteps 100 --yardstick-agents 4  # tiny

Agent-steps per second (compile excluded) of one tabular Q-learning agent on the default
8x12 map (learning rate 0.1, epsilon 0.1, gamma 0.9), written as: a plain Python/NumPy loop
(the articles' starting point), one jitted agent (`jax.jit(train)`), and N = 1, 4, 16, ...
agents through the script's own sharded `make_sweep`, on one device and on all devices, in
cache-sized chunks as main() runs it (and, on a CPU, all at once for contrast). The yardstick
is the article's approach, article_q_learning.py beside this file, run in its own process as
`--timesteps 20000 --num-agents 1024`. Every measurement runs once per repeat, the yardstick
too, so that a busy machine slows all alike; the medians are reported, with the ratios:
4096 agents on all devices vs the yardstick and vs one device, and jit vs the NumPy loop.
Writes benchmark.json and benchmark.png to --output-dir (a new folder each run by default).
"""

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# This file is also called parallel_q_learning: the script's folder must come first.
sys.path[:0] = [str(ROOT), str(HERE)]

import cli  # noqa: E402  (next to this file: a Ctrl-C is one line)

# Imported before jax: it shows each CPU core to jax as a device.
import parallel_q_learning as pq  # noqa: E402

# isort: split
os.environ["MPLBACKEND"] = "Agg"  # a figure file only, whatever the shell's backend
import jax  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

ARTICLE = HERE / "article_q_learning.py"
HPARAMS = pq.HParams(learning_rate=0.1, epsilon=0.1, gamma=0.9)  # the article's
RATIO_AGENTS = 4096  # the headline compares this many agents on all devices
# One agent is dominated by the fixed cost of each block of random bits, so it prefers long
# blocks; many agents prefer short ones (cache), the script's default (measured: see README).
SINGLE_AGENT_BLOCK = 10_000
MIN_STEPS_PER_CELL = 20  # the one greedy evaluation at the end stays under 5% of the steps
CHUNKED, ALL_AT_ONCE = "vmap, chunks", "vmap, all at once"


def numpy_q_learning(env: pq.GridWorld, hparams: pq.HParams, steps: int, seed: int):
    """The same agent as a plain Python loop with NumPy: the articles' starting point."""
    rng = np.random.default_rng(seed)
    q = np.zeros((env.num_cells, pq.NUM_ACTIONS))
    cell, episode_steps = env.start, 0
    for _ in range(steps):
        q_s = q[cell]
        if rng.random() < hparams.epsilon:
            action = int(rng.integers(pq.NUM_ACTIONS))
        else:
            action = int(rng.choice(np.flatnonzero(q_s == q_s.max())))
        reached = int(env.next_cell[cell, action])
        terminated = reached == env.goal
        episode_steps += 1
        truncated = 0 < env.max_episode_steps <= episode_steps
        target = float(terminated) + hparams.gamma * (0.0 if terminated else q[reached].max())
        q[cell, action] += hparams.learning_rate * (target - q[cell, action])
        cell = env.start if terminated or truncated else reached
        episode_steps = 0 if terminated or truncated else episode_steps
    return q


class Point(NamedTuple):
    """One measurement: `run` does one timed run of `agents` x `steps` agent-steps."""

    method: str
    devices: int
    agents: int
    steps: int  # per agent
    compile_s: float
    run: Callable[[], object]


def compiled_point(method: str, devices: int, agents: int, steps: int, fn, args) -> Point:
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*args).compile()
    compile_s = time.perf_counter() - start
    jax.block_until_ready(compiled(*args))  # warm-up
    return Point(method, devices, agents, steps, compile_s, lambda: compiled(*args))


def sweep_point(args, env, agents: int, mesh, chunked: bool) -> Point:
    """N agents as main() trains them: shard_sweep(make_sweep(train)), seeds over the mesh."""
    steps = -(-args.agent_steps // agents)
    steps = max(steps, MIN_STEPS_PER_CELL * env.num_cells)
    config = pq.Config(
        total_timesteps=steps, num_seeds=agents, learning_rates=(HPARAMS.learning_rate,),
        epsilons=(HPARAMS.epsilon,), gammas=(HPARAMS.gamma,), num_curve_points=1,
    )  # fmt: skip
    plan = pq.make_step_plan(config)
    chunks = pq.chunks_per_device(config, env, mesh) if chunked else 1
    sweep = pq.shard_sweep(pq.make_sweep(pq.make_train(config, env, plan)), mesh, chunks)
    keys = pq.make_seed_keys(0, agents, mesh, chunks)
    method = CHUNKED if chunked else ALL_AT_ONCE
    inputs = (keys, pq.hparam_grid(config))
    return compiled_point(method, mesh.size, agents, config.total_timesteps, sweep, inputs)


def run_article(timesteps: int, agents: int) -> float:
    """agent-steps/s printed by the article-style script, in its own process."""
    command = [sys.executable, str(ARTICLE), "--timesteps", str(timesteps)]
    command += ["--num-agents", str(agents)]
    # The plain CPU platform, as its own docstring runs it (one device, all cores).
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = cli.captured(command, env=env)
    match = re.search(r"steps_per_s=([0-9.]+)", done.stdout)
    if done.returncode != 0 or match is None:  # its last line says why (a traceback's end)
        last = ((done.stderr or done.stdout).strip().splitlines() or ["no output"])[-1]
        cli.fail(f"--yardstick-agents, --yardstick-timesteps: {ARTICLE.name} failed: {last}"[:300])
    return float(match.group(1))


def machine() -> str:
    """The CPU model (Linux), else what platform knows, and the core count: for the caption."""
    cpuinfo = Path("/proc/cpuinfo")
    models = re.findall(r"model name\s*: (.*)", cpuinfo.read_text()) if cpuinfo.exists() else []
    return f"{(models or [platform.processor() or platform.machine()])[0]}, {os.cpu_count()} cores"


def plot(bench: dict, path: Path) -> None:
    """Medians with min-max bars over the repeats; machine, date and versions in the caption."""
    fig, ax = plt.subplots(figsize=(7, 5.2))

    def draw(rows, fmt, label, **style):  # one series: medians, bars from min to max
        x = [r["agents"] for r in rows]
        rates = [[r["agents"] * r["steps"] / s for s in r["seconds"]] for r in rows]
        y = np.array([np.median(r) for r in rates])  # from the same runs as the bars
        bars = [y - [min(r) for r in rates], [max(r) for r in rates] - y]
        ax.errorbar(x, y, yerr=bars, fmt=fmt, capsize=3, label=label, **style)

    vmapped = [r for r in bench["rows"] if r["method"] in (CHUNKED, ALL_AT_ONCE)]
    for method, devices in sorted({(r["method"], r["devices"]) for r in vmapped}):
        rows = [r for r in vmapped if (r["method"], r["devices"]) == (method, devices)]
        draw(rows, "o-", f"{method}, {devices} device{'s' if devices > 1 else ''}")
    for row, marker in zip(bench["rows"][:2], ("s", "^"), strict=True):
        draw([row], marker, row["method"], ms=9)
    yardstick, steps = bench["yardstick"], bench["args"]["yardstick_timesteps"]
    seconds = [yardstick["agents"] * steps / rate for rate in yardstick["samples"]]
    yardstick_row = yardstick | {"steps": steps, "seconds": seconds}
    draw([yardstick_row], "kx", "article's approach (yardstick)", ms=10)
    ax.set(xscale="log", yscale="log", xlabel="agents", ylabel="agent-steps / s")
    ax.set_title("Tabular Q-learning, default 8x12 GridWorld (median, bars: min to max)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    repeats, jax_version = bench["args"]["repeats"], bench["versions"]["jax"]
    runs = f"{repeats} run{'s' * (repeats != 1)}"
    fig.text(0.01, 0.01, fontsize=7.5, va="bottom", s=(
        f"{bench['machine']}, {len(bench['devices'])} {bench['devices'][0].split(':')[0]} devices; "
        f"{bench['date']}; jax {jax_version}; {runs} each, compile excluded.\n"
        "The dip at 4 agents: vmap over a handful of agents pays for batched gathers and "
        "scatters\nwithout enough agents to fill them; one jitted agent has none."
    ))  # fmt: skip
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_whole(writes: dict[Path, Callable[[Path], None]]) -> None:
    """Each write(a temporary path), then all renamed to their paths: a stop or a crash leaves
    the files of a previous run or the new ones, never half of one, nor a new benchmark.json
    beside an old benchmark.png. One that fails (a full disk) is one line naming the file."""
    # The suffix last: it tells the format.
    temporaries = {path: path.with_name(f".{path.stem}.tmp{path.suffix}") for path in writes}
    try:
        for path, write in writes.items():
            write(temporaries[path])
        with cli.held():  # all renamed, or none
            for path, temporary in temporaries.items():
                os.replace(temporary, path)
    except OSError as error:  # it was a traceback of 51 lines, after all the measurements
        cli.fail(f"cannot write {path} ({error.strerror or error})", status=1)
    finally:
        for temporary in temporaries.values():
            temporary.unlink(missing_ok=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.parser(__doc__)
    counts = {
        "max_agents": (16384, "largest N (N = 1, 4, 16, ... and this one)"),
        "agent_steps": (20_000_000, "agent-steps of one timed run of each JAX measurement"),
        "numpy_steps": (100_000, "steps of one timed run of the NumPy loop"),
        "repeats": (3, "timed runs of each measurement, alternating; the median is kept"),
        "yardstick_timesteps": (20_000, "--timesteps of article_q_learning.py"),
        "yardstick_agents": (1024, "--num-agents of article_q_learning.py"),
    }
    for name, (default, help_text) in counts.items():
        flag = "--" + name.replace("_", "-")
        parser.add_argument(flag, type=cli.count, default=default, help=help_text)
    output = ROOT / "runs" / "benchmark_parallel_q_learning_{time}"  # a run never overwrites one
    help_text = "where the results go; {time}: its start"
    parser.add_argument("--output-dir", default=str(output), help=help_text)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cli.check_backend()
    env = pq.make_env(pq.DEFAULT_LAYOUT)
    if args.max_agents < jax.device_count():  # the ratios compare runs of an agent a device
        cli.fail(f"--max-agents: at least one per device ({jax.device_count()})")
    check_new_folder(args.output_dir)
    try:  # the largest N must fit in memory; the output folder must be writable; the one-agent
        largest = pq.Config(  # run's steps must fit the script's int32 counters
            num_seeds=args.max_agents,
            learning_rates=(0.1,),
            epsilons=(0.1,),
            output_dir=args.output_dir,
        )
        _, folder = pq.validate(largest, pq.make_step_plan(largest))  # it makes the folder
        args.output_dir = str(folder)  # with {time} filled in
        single_agent_config(args)
        with tempfile.TemporaryFile(dir=args.output_dir):  # os.access lets root "write" to /proc
            pass
    except pq.ConfigError as error:  # validate made the folder: none left empty
        pq.remove_if_empty(Path(args.output_dir))
        message = str(error).replace("--num-seeds", "--max-agents")
        cli.fail(message.replace("--total-timesteps", "--agent-steps"))
    except OSError as error:  # after the measurements, they would be lost
        pq.remove_if_empty(Path(args.output_dir))
        cli.fail(f"--output-dir {args.output_dir}: cannot write a file there ({error.strerror})")
    try:
        measure(args, env)
    except BaseException:  # stopped or failed: no empty folder left
        pq.remove_if_empty(Path(args.output_dir))
        raise


def check_new_folder(template: str) -> None:
    """A run writes into a new or empty folder, as the scripts do without --overwrite: one line
    before any measurement for a folder that holds files, or for {time} with '..' (y/../{time}
    leaves an empty y behind)."""
    given = f"--output-dir {template}"
    if not template:  # Path("") is this folder: it read "already holds files"
        cli.fail("--output-dir must not be empty")
    if "{time}" in template and ".." in Path(template).parts:
        cli.fail(f"{given}: '..' and {{time}} together are refused")
    try:
        held = "{time}" not in template and any(Path(template).iterdir())
    except OSError:  # not there yet, or not a folder that can be read: validate says which
        held = False
    if held:
        cli.fail(f"{given} already holds files: name a new or empty folder")


def single_agent_config(args: argparse.Namespace) -> pq.Config:
    """The one-agent run: --agent-steps in whole blocks (ConfigError past the script's limits)."""
    steps = -(-args.agent_steps // SINGLE_AGENT_BLOCK) * SINGLE_AGENT_BLOCK
    if steps >= 2**31:  # the value given may be below it: say what it became
        rounded = f"in whole blocks of {SINGLE_AGENT_BLOCK:,} steps it makes {steps:,}"
        raise pq.ConfigError("total_timesteps", f"{rounded}, beyond the script's 2^31 - 1")
    return pq.Config(total_timesteps=steps, num_curve_points=1, rng_block_steps=SINGLE_AGENT_BLOCK)


def measure(args: argparse.Namespace, env: pq.GridWorld) -> None:
    """Every measurement and the yardstick, alternating; then the table, the file, the figure."""
    # The yardstick first: one that cannot run (too many agents) stops before ours compile.
    yardstick = [run_article(args.yardstick_timesteps, args.yardstick_agents)]
    counts = [4**i for i in range(20) if 4**i < args.max_agents] + [args.max_agents]
    devices = jax.devices()
    print(f"compiling the measurements ({len(devices)} {devices[0].platform} devices) ...")

    def numpy_run():
        return numpy_q_learning(env, HPARAMS, args.numpy_steps, seed=0)

    points = [Point("numpy loop", 1, 1, args.numpy_steps, 0.0, numpy_run)]
    single = single_agent_config(args)
    steps = single.total_timesteps
    train = pq.make_train(single, env)
    hparams = pq.HParams(*(np.float32(x) for x in HPARAMS))
    points.append(
        compiled_point("jit, one agent", 1, 1, steps, train, (jax.random.key(0), hparams))
    )
    series = [(pq.seed_mesh(devices[:1]), True), (pq.seed_mesh(devices), True)]
    if devices[0].platform == "cpu":  # chunks are a CPU layout; a GPU takes all at once anyway
        series.append((pq.seed_mesh(devices), False))
    for mesh, chunked in series:
        # N below the device count would only measure padding: start at one agent per device.
        points += [sweep_point(args, env, n, mesh, chunked) for n in counts if n >= mesh.size]

    # Alternate: the yardstick and every measurement once per repeat; medians after.
    seconds = {point: [] for point in points}
    for repeat in range(args.repeats):
        if repeat:
            yardstick.append(run_article(args.yardstick_timesteps, args.yardstick_agents))
        for point in points:
            start = time.perf_counter()
            jax.block_until_ready(point.run())
            seconds[point].append(time.perf_counter() - start)
        print(f"repeat {repeat + 1}/{args.repeats} done", flush=True)

    rows = []
    print(f"  {'method':<18} {'devices':>7} {'agents':>7} {'steps':>10} {'M agent-steps/s':>16}")
    for point in points:
        rate = point.agents * point.steps / statistics.median(seconds[point])
        rows.append(point._asdict() | {"agent_steps_per_s": rate, "seconds": seconds[point]})
        del rows[-1]["run"]
        print(
            f"  {point.method:<18} {point.devices:>7} {point.agents:>7} {point.steps:>10} "
            f"{rate / 1e6:16.2f}"
        )
    article = {
        "command": f"python benchmarks/{ARTICLE.name} --timesteps {args.yardstick_timesteps} "
        f"--num-agents {args.yardstick_agents}",
        "agents": args.yardstick_agents,
        "agent_steps_per_s": statistics.median(yardstick),
        "samples": yardstick,
    }
    print(
        f"  {'yardstick':<18} {1:>7} {args.yardstick_agents:>7} {args.yardstick_timesteps:>10} "
        f"{article['agent_steps_per_s'] / 1e6:16.2f}   ({article['command']})"
    )

    rate = {(r["method"], r["devices"], r["agents"]): r["agent_steps_per_s"] for r in rows}
    n = RATIO_AGENTS if RATIO_AGENTS in counts else counts[-1]
    best = rate[(CHUNKED, len(devices), n)]
    name = f"{CHUNKED} {n} agents on {len(devices)} devices"
    ratios = {
        f"{name} / yardstick": best / article["agent_steps_per_s"],
        f"{name} / on 1 device": best / rate[(CHUNKED, 1, n)],
        "jit one agent / numpy loop": rows[1]["agent_steps_per_s"] / rows[0]["agent_steps_per_s"],
        f"{name} / numpy loop": best / rows[0]["agent_steps_per_s"],
    }
    if (ALL_AT_ONCE, len(devices), n) in rate:
        ratios[f"{name} / {ALL_AT_ONCE}"] = best / rate[(ALL_AT_ONCE, len(devices), n)]
    for ratio_name, ratio in ratios.items():
        print(f"{ratio_name}: {ratio:.1f}x")

    output = Path(args.output_dir)
    output.mkdir(parents=True, exist_ok=True)
    bench = {
        "args": vars(args),
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "versions": pq.versions(),
        "devices": [f"{d.platform}:{d.id} {d.device_kind}" for d in devices],
        "hparams": HPARAMS._asdict(),
        "rows": rows,
        "yardstick": article,
        "ratios": ratios,
    }
    text = json.dumps(bench, indent=2) + "\n"
    writes = {output / "benchmark.json": lambda path: path.write_text(text)}
    writes[output / "benchmark.png"] = lambda path: plot(bench, path)
    write_whole(writes)
    print(f"wrote benchmark.json and benchmark.png to {output}/")


if __name__ == "__main__":
    cli.run(main)
