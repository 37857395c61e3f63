"""Plots kccl benchmark JSON into a PNG.  Usage: plot.py KIND JSON PNG.

Run by `kccl bench ... --plot` with /usr/bin/python3 (Debian's matplotlib).
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def broadcast(records, png):
    sizes = sorted({r["size"] for r in records})
    recvs = sorted({r["receivers"] for r in records})
    paths = sorted({r["path"] for r in records})
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    big = max(sizes)
    for p in paths:
        rows = sorted((r for r in records if r["path"] == p and r["size"] == big), key=lambda r: r["receivers"])
        x = [r["receivers"] for r in rows]
        axes[0].plot(x, [r["p50_us"] for r in rows], marker="o", label=f"{p} p50")
        axes[0].plot(x, [r["p99_us"] for r in rows], marker="x", linestyle="--", label=f"{p} p99")
    axes[0].set(title=f"held latency vs receivers ({big} B packets)", xlabel="receivers", ylabel="µs")
    most = max(recvs)
    for p in paths:
        rows = sorted((r for r in records if r["path"] == p and r["receivers"] == most), key=lambda r: r["size"])
        x = [r["size"] for r in rows]
        axes[1].plot(x, [r["p50_us"] for r in rows], marker="o", label=f"{p} p50")
        axes[1].plot(x, [r["p99_us"] for r in rows], marker="x", linestyle="--", label=f"{p} p99")
    axes[1].set(title=f"held latency vs packet size ({most} receivers)", xlabel="UDP payload bytes", ylabel="µs")
    for p in paths:
        rows = sorted((r for r in records if r["path"] == p and r["size"] == big), key=lambda r: r["receivers"])
        axes[2].plot([r["receivers"] for r in rows], [r["sender_cpu_us"] for r in rows], marker="o", label=p)
    axes[2].set(title="sender CPU per broadcast", xlabel="receivers", ylabel="µs CPU")
    for a in axes:
        a.grid(True, alpha=0.3)
        a.legend()
        a.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def aggregation(records, png):
    """reduce/allreduce: throughput and time per operation vs vector size."""
    kind = records[0]["kind"] if records else "aggregation"
    paths = sorted({r["path"] for r in records})
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for p in paths:
        rows = sorted((r for r in records if r["path"] == p), key=lambda r: r["bytes"])
        x = [r["bytes"] / 2**20 for r in rows]
        axes[0].plot(x, [r["elems_per_s"] / 1e6 for r in rows], marker="o", label=p)
        axes[1].plot(x, [r["p50_ms"] for r in rows], marker="o", label=f"{p} p50")
        axes[1].plot(x, [r["p99_ms"] for r in rows], marker="x", linestyle="--", label=f"{p} p99")
    senders = records[0]["senders"] if records else 0
    axes[0].set(title=f"{kind} throughput ({senders} senders)", xlabel="MiB per rank", ylabel="M elements/s")
    axes[1].set(title=f"{kind} time per operation", xlabel="MiB per rank", ylabel="ms")
    for a in axes:
        a.set_xscale("log")
        a.grid(True, alpha=0.3)
        a.legend()
        a.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def cpu(records, png):
    paths = sorted({r["path"] for r in records})
    fig, ax = plt.subplots(figsize=(7, 4.8))
    for p in paths:
        rows = sorted((r for r in records if r["path"] == p), key=lambda r: r["senders"])
        ax.plot([r["senders"] for r in rows], [r["cpu_pct"] for r in rows], marker="o", label=p)
    ax.set(title="aggregator CPU at a paced reduce load", xlabel="senders", ylabel="% of one CPU")
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def loss(records, png):
    """Throughput under loss relative to no loss, per collective and path."""
    colls = [c for c in ("reduce", "broadcast") if any(r["collective"] == c for r in records)]
    fig, axes = plt.subplots(1, max(len(colls), 1), figsize=(6 * max(len(colls), 1), 4.8), squeeze=False)
    for ax, c in zip(axes[0], colls):
        for p in sorted({r["path"] for r in records}):
            rows = sorted((r for r in records if r["collective"] == c and r["path"] == p), key=lambda r: r["loss"])
            x = [r["loss"] * 100 for r in rows]
            ax.plot(x, [r["relative"] for r in rows], marker="o", label=p)
        ax.axhline(0.8, color="grey", linestyle=":", label="target 0.8x (kernel, 1%)")
        # Loss rates span decades and include 0: symlog, no negative side.
        ax.set_xscale("symlog", linthresh=0.01)
        top = max((r["loss"] * 100 for r in records), default=1.0)
        ax.set_xlim(left=0, right=max(top, 0.01) * 1.5)
        ax.set(title=f"{c}: throughput under loss (seed {records[0]['seed']})", xlabel="loss on every link (%)",
               ylabel="x of no-loss throughput")
        ax.grid(True, alpha=0.3)
        ax.legend()
        ax.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def suite(records, png):
    """One experiment of `kccl bench all`: per series (the model for
    param-server) the median per system (error bars: min-max of the repeats'
    medians) and p99 (dashed), then the ratio to the user-space path."""
    r = records[0]
    series = sorted({row["series"] for row in r["rows"]})
    systems = sorted({row["system"] for row in r["rows"]})
    colors = {s: f"C{i}" for i, s in enumerate(systems)}
    fig, axes = plt.subplots(1, len(series) + 1, figsize=(6.5 * (len(series) + 1), 5), squeeze=False)
    axes = axes[0]

    def num(v):
        return float("nan") if v is None else v

    for ax, ser in zip(axes, series):
        for sysname in systems:
            rows = sorted((x for x in r["rows"] if x["series"] == ser and x["system"] == sysname), key=lambda x: x["x"])
            if not rows:
                continue
            xs = [x["x"] for x in rows]
            med = [num(x["median"]) for x in rows]
            lo = [m - min(num(v) for v in x["repeat_medians"]) for m, x in zip(med, rows)]
            hi = [max(num(v) for v in x["repeat_medians"]) - m for m, x in zip(med, rows)]
            c = colors[sysname]
            ax.errorbar(xs, med, yerr=[lo, hi], marker="o", capsize=3, color=c, label=f"{sysname} median")
            p99 = [num(x["p99"]) for x in rows]
            if any(v == v for v in p99):
                ax.plot(xs, p99, marker="x", linestyle="--", color=c, alpha=0.6, label=f"{sysname} p99")
            ratio = [num(x["ratio_to_user"]) for x in rows]
            if sysname != "kccl-user" and any(v == v for v in ratio):
                style = ["-", "--", ":", "-."][series.index(ser) % 4]
                axes[-1].plot(xs, ratio, marker="os^v"[series.index(ser) % 4], color=c, linestyle=style,
                              label=f"{ser} {sysname}".strip())
        ax.set(title=(ser + ": " if ser else "") + r["unit"], xlabel=r["x_label"], ylabel=r["unit"])
        if r["unit"] in ("us", "ms"):
            ax.set_yscale("log")
        else:
            ax.set_ylim(bottom=0)
    axes[-1].axhline(1.0, color="grey", linestyle=":", label="kccl-user")
    axes[-1].set(title="median / kccl-user median (< 1: faster)", xlabel=r["x_label"], ylabel="x")
    axes[-1].set_ylim(bottom=0)
    if any(v > 20 for v in (num(x["ratio_to_user"]) for x in r["rows"])):
        axes[-1].set_yscale("symlog", linthresh=1)
    for a in axes:
        if r["log_x"]:
            a.set_xscale("log", base=2)
        a.grid(True, alpha=0.3)
        a.legend(fontsize=7)
    fig.suptitle(f"{r['title']}: {r['metric']}  ({r['date']}{', SMOKE' if r['smoke'] else ''})", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=100)


KINDS = {"broadcast": broadcast, "reduce": aggregation, "allreduce": aggregation, "cpu": cpu, "loss": loss, "suite": suite}

if __name__ == "__main__":
    kind, src, dst = sys.argv[1:4]
    with open(src) as f:
        KINDS[kind](json.load(f), dst)
