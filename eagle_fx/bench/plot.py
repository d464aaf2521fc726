"""`eagle-fx bench --plot PATH`: the run's figures as one PNG (matplotlib, the `plot` extra).

Left: acceptance rate at each draft position (vLLM's "acceptance at token i"). Right: tokens/s
of every method the run measured (eagle_fx alone, or with --compare every baseline beside it).
"""
from __future__ import annotations

from pathlib import Path


def check_available() -> None:
    """A one-line SystemExit when matplotlib is missing (before any model is loaded)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'eagle_fx[plot]' (or pip install matplotlib)") from None


def write(path, acceptance_at: list[float], tokens_per_s: dict[str, float], title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [1, 2]})
    left.bar([str(i) for i in range(len(acceptance_at))], acceptance_at, color="tab:blue")
    left.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1), title="acceptance per position")
    names = list(tokens_per_s)
    right.barh(names, [tokens_per_s[n] for n in names],
               color=["tab:orange" if n.startswith("eagle_fx") else "tab:gray" for n in names])
    right.invert_yaxis()
    right.set(xlabel="tokens/s", title="tokens/s per method")
    for i, n in enumerate(names):
        right.text(tokens_per_s[n], i, f" {tokens_per_s[n]:.0f}", va="center")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
