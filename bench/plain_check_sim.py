"""The plain check's rules (eagle_fx/serving/plain_check.py) on simulated epochs: what share of the best
arm's rate each schedule delivers, for arm rates and epoch noise like those measured on this CPU.

Each epoch of an arm has the rate `rates[arm] * exp(N(0, sigma))`; an epoch of a speculating arm right
after a plain one pays `--switch-cost` of its rate (the draft's catch-up). A load's check runs
`--epochs` epochs (about 40 at 16 in flight in bench/engine_load.py's rounds, 200 over a minute of
serving); the efficiency is the mean of each epoch's true rate over the best arm's, averaged over
`--seeds` runs. Rates per scenario are relative (the best 1.0): "1", "4", "16", "64" are the ratios
of fixed k = 3 / k = 0 measured in one process at stop 55 (full = k = 3, plain = k = 0, adaptive
~4% below the better of them, as measured); "full-loses" is stop 51's 4 in flight (k = 3 0.83x k =
0); "adaptive-wins" a case where pick_k's choices beat both. Noise: the paired comparisons of one
engine's adjacent epochs were 10-25% apart at 16-64 in flight (stop 55).

    python bench/plain_check_sim.py
    git show REV:eagle_fx/serving/plain_check.py > /tmp/old_plain_check.py
    python bench/plain_check_sim.py --compare /tmp/old_plain_check.py
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import random
import statistics
import sys

from eagle_fx.serving import plain_check

SCENARIOS = {
    "1": {"full": 1.0, "plain": 0.75, "adaptive": 0.96},
    "4": {"full": 1.0, "plain": 0.90, "adaptive": 0.96},
    "16": {"full": 1.0, "plain": 0.95, "adaptive": 0.96},
    "64": {"full": 1.0, "plain": 1.0, "adaptive": 0.96},
    "full-loses": {"full": 0.83, "plain": 1.0, "adaptive": 0.95},
    "adaptive-wins": {"full": 0.95, "plain": 0.90, "adaptive": 1.0},
}


def efficiency(module, rates: dict, sigma: float, epochs: int, switch_cost: float, seed: int) -> float:
    """Mean true rate / the best arm's over `epochs` epochs of one load's check from `module`."""
    rnd, load = random.Random(seed), module.Load()
    if hasattr(load, "at_k_max"):  # (a check from before stop 55: full tried once pick_k chose the largest k)
        load.at_k_max.extend([True] * module.FULL_WINDOW)
    best, total, previous = max(rates.values()), 0.0, None
    for _ in range(epochs):
        arm = load.arm
        rate = rates[arm] * (1 - switch_cost if previous == "plain" and arm != "plain" else 1)
        total += rate / best
        load.closed(rate * math.exp(rnd.gauss(0, sigma)))
        previous = arm
    return total / epochs


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("compared_plain_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--sigma", default="0.1,0.2", help="comma list of epoch noise (sd of log rate)")
    parser.add_argument("--epochs", default="40,200", help="comma list of epochs per load")
    parser.add_argument("--seeds", type=int, default=300)
    parser.add_argument("--switch-cost", type=float, default=0.05)
    parser.add_argument("--compare", metavar="PATH", help="another plain_check.py to run beside this one")
    args = parser.parse_args(argv)
    modules = {"current": plain_check}
    if args.compare:
        modules["compared"] = load_module(args.compare)
    print("efficiency (share of the best arm's rate) per scenario: " + ", ".join(modules))
    for sigma in map(float, args.sigma.split(",")):
        for epochs in map(int, args.epochs.split(",")):
            cells = []
            for name, rates in SCENARIOS.items():
                values = [statistics.mean(efficiency(m, rates, sigma, epochs, args.switch_cost, s)
                                          for s in range(args.seeds)) for m in modules.values()]
                cells.append(f"{name}: " + " / ".join(f"{v:.3f}" for v in values))
            print(f"sigma {sigma}, {epochs} epochs | " + " | ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
