#!/usr/bin/env python
"""Herald next to the systems it answers, all trained by `train.py` in the same engine, on the same data, at equal
samples:

    .venv/bin/python benchmarks/compare.py --steps 200 --out benchmarks/results/compare.json \\
        --plot benchmarks/results/compare.png

Systems (`--systems`, default all): stock TorchRec ROW_WISE (`torchrec_rw`) and TABLE_WISE (`torchrec_tw`);
HET-BSP (`het_bsp`: scheduler=het, staleness 0 — exact BSP); HET with staleness 2 and 8 (`het_s2`, `het_s8`: stale
reads are its trade); FAE (`fae`: hot/cold batches, reordered stream); P²RES (`p2res`: replicated rows all-reduced,
exact); Herald (`herald`). Per system: `comm_bytes_per_step` (every rank together, embeddings + sample exchange,
the one counter every scheduler is measured by), `step_ms` on this host's loopback, AUC and log loss on the
held-out split, stale reads (the (key, reader) pairs served an older value than the latest), hit rate and the
scheduler's planned rows by kind. Real logs: pass Hydra overrides after the options (e.g. `data=criteo
data.path=...`); they go to every run. One JSON object on stdout (and, atomically, to --out); --plot draws bytes per
step and AUC per system (PNG). Run helpers are benchmarks/e2e.py's. With `--bandwidth none,200mbit` (root + iproute2)
every system is also timed with each rank its own host behind a tc-shaped link (e2e.py's network mode): steady step
ms and the bytes really on the wire, per rate, under "network" in the JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import e2e  # noqa: E402  (benchmarks/ is not a package)

SYSTEMS = {
    "torchrec_rw": e2e.SCHEDULER_ARGS["torchrec"],
    **{s: e2e.SCHEDULER_ARGS[s] for s in ("torchrec_tw", "het_bsp", "het_s2", "het_s8", "fae", "p2res", "herald")},
}
e2e.SCHEDULER_ARGS.update({k: v for k, v in SYSTEMS.items() if k not in e2e.SCHEDULER_ARGS})


def run_system(name: str, args: argparse.Namespace, out_dir: Path) -> dict:
    """One system's run (e2e.run_one, loopback), plus the metrics e2e does not summarise; {"error": ...} if it
    failed, so that one broken baseline does not lose the others."""
    try:
        rec = e2e.run_one(args.ranks, name, args, out_dir)
    except SystemExit as e:
        return {"error": str(e)}
    m = json.loads((out_dir / f"r{args.ranks}-{name}" / "metrics.json").read_text())
    rec.update(
        logloss=m["logloss"],
        stale_reads=m.get("stale_reads", 0),
        plan_rows_by_kind=m.get("plan_rows_by_kind"),
        replicated_rows=(m.get("policy") or {}).get("replicated_rows"),
        fae_hot_sample_share=m.get("fae_hot_sample_share"),
    )
    return rec


AUC_NOISE = (
    1e-3  # AUC differences below this are float-order noise between equal models (exact systems differ by ~1e-4)
)


def summary(runs: dict) -> dict:
    """Ratios to Herald and the systems that beat it on bytes, step time or AUC (by more than AUC_NOISE), said
    plainly in the README."""
    h = runs.get("herald")
    if not h or "error" in h:
        return {}
    out: dict = {"vs_herald": {}, "beats_herald": {"bytes": [], "step_ms": [], "auc": []}}
    for s, r in runs.items():
        if s == "herald" or "error" in r:
            continue
        out["vs_herald"][s] = {
            "bytes": r["comm_bytes_per_step"] / max(h["comm_bytes_per_step"], 1e-9),
            "step_ms": r["step_ms"] / h["step_ms"],
            "auc_delta": r["auc"] - h["auc"],
        }
        if r["comm_bytes_per_step"] < h["comm_bytes_per_step"]:
            out["beats_herald"]["bytes"].append(s)
        if r["step_ms"] < h["step_ms"]:
            out["beats_herald"]["step_ms"].append(s)
        if r["auc"] > h["auc"] + AUC_NOISE:
            out["beats_herald"]["auc"].append(s)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {s: r for s, r in result["runs"].items() if "error" not in r}
    names = list(runs)
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = ["tab:red" if n == "herald" else "tab:gray" if n.startswith("torchrec") else "tab:blue" for n in names]
    a.bar(names, [runs[n]["comm_bytes_per_step"] / 1e6 for n in names], color=colors)
    a.set_ylabel("MB per step (all ranks)")
    a.set_title("communication")
    aucs = [runs[n]["auc"] for n in names]
    b.bar(names, aucs, color=colors)
    lo = min(aucs) if aucs else 0.5
    b.set_ylim(max(0.0, lo - 0.02), max(aucs + [lo]) + 0.01)
    b.set_ylabel("held-out AUC")
    b.set_title("accuracy")
    for ax in (a, b):
        ax.tick_params(axis="x", rotation=35)
    c = result["config"]
    fig.suptitle(f"{c['ranks']} ranks x batch {c['batch']}, {c['steps']} steps, model {c['model']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp{path.suffix}")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


def markdown(result: dict) -> str:
    rows = [
        "| system | bytes/step | step ms | AUC | logloss | stale reads | hit rate |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for s, r in result["runs"].items():
        if "error" in r:
            rows.append(f"| {s} | failed | | | | | |")
            continue
        hr = r.get("hit_rate")
        hr = "" if hr is None or (isinstance(hr, float) and math.isnan(hr)) else f"{hr:.2f}"
        rows.append(
            f"| {s} | {r['comm_bytes_per_step'] / 1e3:,.0f} kB | {r['step_ms']:.1f} | {r['auc']:.4f} | "
            f"{r['logloss']:.4f} | {r['stale_reads']} | {hr} |"
        )
    return "\n".join(rows)


def network_timing(args: argparse.Namespace, systems: list[str]) -> dict:
    """Every system timed on emulated links (e2e_net.main_net: one network namespace per rank, tc-shaped); exits 2
    with the reason where this machine cannot build them."""
    import e2e_net
    import netem

    net_args = argparse.Namespace(
        **{
            **vars(args),
            "steps": args.net_steps,
            "workload": None,
            "timeout": 900.0,
            "phase_times": False,
            "plot": None,
        }
    )
    try:
        return e2e_net.main_net(net_args, [args.ranks], systems)
    except netem.NetemUnavailable as err:
        e2e_net.exit_unavailable(err)
    except ValueError as err:
        raise SystemExit(f"compare: {err}")


def network_markdown(net: dict) -> str:
    """Steady step ms (best of rounds) per system and link rate, with the bytes really on the wire."""
    import e2e_net

    bws = net["config"]["bandwidth"]
    head = " | ".join(f"{'unshaped' if b == 'none' else b}: step ms (wire MB)" for b in bws)
    rows = [f"| system | {head} |", "|---|" + "---:|" * len(bws)]
    for w, per_bw in net["runs"].items():
        for s in net["config"]["schedulers"]:
            cells = []
            for b in bws:
                c = per_bw.get(b, {}).get(str(net["config"]["ranks"][0]), {}).get(s)
                if c is None:
                    cells.append("failed")
                    continue
                best = c["best"]
                wire = best.get("wire_bytes_per_step")
                cells.append(f"{e2e_net.step_of(best):.1f}" + (f" ({wire / 1e6:.2f})" if wire is not None else ""))
            rows.append(f"| {s} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {list(SYSTEMS)}")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200, help="global batches each system trains (equal samples)")
    ap.add_argument("--batch", type=int, default=256, help="per-rank batch")
    ap.add_argument("--cache-ratio", type=float, default=0.1, help="Herald / HET cache; sizes fae / p2res hot_budget")
    ap.add_argument("--locality", type=float, default=0.5)
    ap.add_argument("--model", default="dcn")
    ap.add_argument("--out", type=Path, help="also write the JSON here (atomically)")
    ap.add_argument("--plot", type=Path, help="bytes per step and AUC per system (PNG)")
    ap.add_argument("--replot", type=Path, metavar="JSON", help="run nothing: --plot and the table from a JSON")
    net = ap.add_argument_group("network timing (root + iproute2; benchmarks/e2e.py's network mode)")
    net.add_argument(
        "--bandwidth",
        help="also time every system with each rank its own host behind a tc-shaped link: "
        "comma list of per-rank rates, e.g. none,200mbit (none = the same topology, unshaped)",
    )
    net.add_argument("--rounds", type=int, default=1, help="alternating rounds of the network timing (best, median)")
    net.add_argument("--net-steps", type=int, default=60, help="steps of each network-timed run")
    net.add_argument("--warmup-steps", type=int, default=10, help="steps left out of the steady step time")
    ap.add_argument("extra", nargs="*", help="further Hydra overrides for every run (e.g. real data)")
    args = ap.parse_args()
    args.phase_times = False  # e2e.run_one reads it
    if args.replot:
        result = json.loads(args.replot.read_text())
    else:
        systems = args.systems.split(",")
        bad = [s for s in systems if s not in SYSTEMS]
        if bad or args.ranks < 1 or args.steps < 1:
            raise SystemExit(f"compare: systems must be in {list(SYSTEMS)} (got {bad}), ranks >= 1, steps >= 1")
        with tempfile.TemporaryDirectory(prefix="herald-compare-") as tmp:
            runs = {s: run_system(s, args, Path(tmp)) for s in systems}
        cfg = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
        result = {"config": cfg, "runs": runs, "summary": summary(runs)}
        if args.bandwidth:
            result["network"] = network_timing(args, systems)
        text = json.dumps(result, indent=2, default=str)
        print(text)
        if args.out:
            e2e.write_atomic(args.out, text + "\n")
    if args.plot:
        plot(result, args.plot)
    print(markdown(result), file=sys.stderr)
    if result.get("network"):
        print("\n" + network_markdown(result["network"]), file=sys.stderr)
    failed = [s for s, r in result["runs"].items() if "error" in r]
    if failed and not args.replot:
        raise SystemExit(f'compare: {failed} failed (see their "error" in the JSON)')


if __name__ == "__main__":
    main()
