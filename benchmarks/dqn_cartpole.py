"""Side-by-side speed: dqn_cartpole.py against the article-style yardstick, same run.

    python benchmarks/dqn_cartpole.py                 # from the repository root
    python benchmarks/dqn_cartpole.py --timesteps 5000 --num-agents 64

Both train 64 agents for 5000 steps at the article's settings (MLP 64-64-64, batch 32,
buffer 512, one update per env step, target copy every 10 steps, gamma 0.9, plain DQN,
our agent keeps its Huber loss and gradient clipping, which cost next to nothing).
The yardstick runs `jit(vmap)` on one device, as written; ours runs `jit(vmap)` with the
seeds sharded over 2 CPU devices (and, for reference, over 1). Compile time is excluded
from both; our timing includes one final greedy evaluation (1 episode, <= 500 steps).
Each side runs in its own process so that XLA_FLAGS can differ. Prints agent-steps/s
and the ratio.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
YARDSTICK = ROOT / ".." / "shared" / "baselines" / "seed_style_dqn.py"

OURS = """
import dataclasses, sys, time
sys.path.insert(0, {root!r})
import dqn_cartpole as dqn
config = dataclasses.replace(
    dqn.Config(), total_timesteps={steps}, eval_every={steps}, num_seeds={agents},
    hidden_sizes=(64, 64, 64), batch_size=32, buffer_size=512, train_frequency=1,
    learning_starts=0, target_update_interval=10, tau=1.0, gamma=0.9,
    learning_rate=1e-3, anneal_lr=False, double_dqn=False, layer_norm=False,
    eval_episodes=1)
plan = dqn.plan_seeds(config)
_, compile_s, train_s = dqn.train_seeds(config, plan)
print(f"ours steps_per_s={{config.total_timesteps * config.num_seeds / train_s:.0f}} "
      f"devices={{plan.num_devices}} compile_s={{compile_s:.1f}} seconds={{train_s:.3f}}")
"""


def run(cmd: list[str], env_update: dict[str, str]) -> tuple[float, str]:
    env = {**os.environ, **env_update}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    line = [ln for ln in out.stdout.splitlines() if "steps_per_s=" in ln][-1]
    return float(re.search(r"steps_per_s=(\d+)", line).group(1)), line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timesteps", type=int, default=5_000)
    parser.add_argument("--num-agents", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs; medians")
    args = parser.parse_args()

    yardstick = [
        sys.executable, str(YARDSTICK),
        "--timesteps", str(args.timesteps), "--num-agents", str(args.num_agents),
    ]  # fmt: skip
    ours = [sys.executable, "-c", OURS.format(root=str(ROOT), steps=args.timesteps,
                                              agents=args.num_agents)]  # fmt: skip
    # The three alternate, so that a machine that slows down for a while slows all of them;
    # the yardstick alone varied 29k-39k agent-steps/s between runs on an idle machine.
    runs = {"yardstick": [], 2: [], 1: []}
    for repeat in range(args.repeats):
        for name, cmd, flags in (
            ("yardstick", yardstick, ""),
            (2, ours, "--xla_force_host_platform_device_count=2"),
            (1, ours, "--xla_force_host_platform_device_count=1"),
        ):
            speed, line = run(cmd, {"XLA_FLAGS": flags})
            runs[name].append(speed)
            print(f"repeat {repeat + 1}/{args.repeats}: {line}", flush=True)
    yard, two, one = (statistics.median(runs[k]) for k in ("yardstick", 2, 1))
    print(
        f"medians (agent-steps/s): yardstick {yard:.0f}, ours on 2 devices {two:.0f}, "
        f"on 1 {one:.0f}"
    )
    print(
        f"speed-up vs yardstick: {two / yard:.2f}x sharded over 2 CPU devices, "
        f"{one / yard:.2f}x on 1 device"
    )


if __name__ == "__main__":
    main()
