"""GPU memory expanded over CXL: modelled time per kernel and memory mode (boots ``single``).

    scripts/bench gpumem [--quick] [--json] [--figure PATH] [--backend type1|iommufd] [--lab NAME]

Sweeps kernel x working set (0.5x .. 8x the VRAM cache) x latency profile x mode; every
run is verified by the guest.  Modes ``uvm`` (NVIDIA's driver: fault batches, 2 MiB VA
blocks, density prefetch) and ``uvm-naive`` (one fault, one 64 KiB page at a time) get a
VRAM cache of ``--vram`` bytes (the guest driver's cache); the cxl modes read and write
the far window directly.  A uvm run with the working set <= the VRAM cache is measured
warm (a first run brings the pages in; the second is measured), the others cold.

Printed per run: modelled time (docs/gpu-memory.md: a function of the device's counters
and the model, printed under "model"), the speed-up against ``uvm`` at the same kernel,
working set and latency, the main counters, and wall time (how long the lab took;
never mixed with modelled time).  Then the checks of issue 21 and, once, the speed of
the lab itself: stream over the whole 256 MiB far window in mode cxl.

``--quick``: stream, stencil and gemv at 0.5x and 4x, both CXL latencies, every mode.
The figure is written as SVG and PNG (the same name, both suffixes).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from ..devices.gpu import model, regs
from ..lab import topology
from ..lab.borrow import add_lab_option, booted_or_borrowed
from ..lab.lab import Lab
from .options import add_kernel_option, guest_kernel, kernel_asked

MODES = list(regs.MODES)  # cxl, cxl+sr, cxl+ds, cxl+sr+ds, uvm, uvm-naive
UVM_MODES = ("uvm", "uvm-naive")
SPEED_WS = 256 << 20
# seed 004 (HotStorage 2024): CXL with SR+DS against UVM, and the 80 ns controller against 250 ns
PAPER_VS_UVM = 2.36
PAPER_80_VS_250 = 1.36


def plan(quick: bool, vram: int) -> list[dict]:
    kernels = ["stream", "stencil", "gemv"] if quick else list(regs.KERNELS)
    factors = [0.5, 4] if quick else [0.5, 1, 2, 4, 8]
    latencies = ["cxl-80ns", "cxl-250ns"] if quick else list(regs.LATENCY_PROFILES)
    runs = []
    for k in kernels:
        for f in factors:
            ws = int(vram * f)
            for lat in latencies:
                for mode in MODES:
                    runs.append({"kernel": k, "mode": mode, "latency": lat, "working_set": ws,
                                 "factor": f, "vram_cache": vram, "unit": "64K",
                                 "warm": mode in UVM_MODES and f <= 1})
    return runs


def speedups(rows: list[dict]) -> None:
    base = {(r["kernel"], r["factor"], r["latency"]): r["modelled_ns"] for r in rows if r["mode"] == "uvm"}
    for r in rows:
        b = base.get((r["kernel"], r["factor"], r["latency"]))
        r["speedup_vs_uvm"] = b / r["modelled_ns"] if b and r["modelled_ns"] else None


def checks(rows: list[dict]) -> list[dict]:
    def t(kernel, mode, lat, big):
        got = [r["modelled_ns"] for r in rows if r["kernel"] == kernel and r["mode"] == mode
               and r["latency"] == lat and (r["factor"] >= 2 if big else r["factor"] <= 1)]
        return got[0] if got else None

    out = []
    for k in ("stream", "stencil", "gemv"):
        for base in UVM_MODES:
            for lat in ("cxl-80ns", "cxl-250ns"):
                uvm, best = t(k, base, lat, True), t(k, "cxl+sr+ds", lat, True)
                if uvm and best:
                    out.append({"check": f"{k}, working set >= 2x VRAM: {lat} cxl+sr+ds vs {base}",
                                "value": uvm / best, "paper": PAPER_VS_UVM,
                                "target": f">= 1 (paper: {PAPER_VS_UVM})", "ok": uvm / best >= 1})
    slow, fast = t("stream", "cxl", "cxl-250ns", True), t("stream", "cxl", "cxl-80ns", True)
    if slow and fast:
        out.append({"check": "stream, mode cxl: cxl-80ns vs cxl-250ns", "value": slow / fast,
                    "paper": PAPER_80_VS_250, "target": f">= 1.3 (paper: {PAPER_80_VS_250})",
                    "ok": slow / fast >= 1.3})
    for k in ("stream", "stencil"):
        for lat in ("cxl-80ns", "cxl-250ns"):
            warm, cxl = t(k, "uvm", lat, False), t(k, "cxl", lat, False)
            if warm and cxl:
                out.append({"check": f"{k} {lat}, working set <= VRAM: warm uvm vs cxl",
                            "value": cxl / warm, "target": ">= 1 (uvm at least as fast)",
                            "ok": cxl / warm >= 1})
    return out


def figure(rows: list[dict], path: str, vram: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    big = max(r["factor"] for r in rows)
    lats = [lat for lat in regs.LATENCY_PROFILES if any(r["latency"] == lat for r in rows)]
    kernels = [k for k in regs.KERNELS if any(r["kernel"] == k for r in rows)]
    fig, axes = plt.subplots(1, len(lats), figsize=(4.2 * len(lats), 3.2), sharey=True, squeeze=False)
    width = 0.8 / len(MODES)
    for ax, lat in zip(axes[0], lats):
        for i, mode in enumerate(MODES):
            ys = []
            for k in kernels:
                sel = [r for r in rows if r["kernel"] == k and r["latency"] == lat and r["factor"] == big]
                uvm = next((r["modelled_ns"] for r in sel if r["mode"] == "uvm"), None)
                mine = next((r["modelled_ns"] for r in sel if r["mode"] == mode), None)
                ys.append(mine / uvm if uvm and mine else 0)
            ax.bar([j + (i - len(MODES) / 2 + 0.5) * width for j in range(len(kernels))], ys, width,
                   label=mode)
        ax.set_xticks(range(len(kernels)), kernels)
        ax.set_yscale("log")
        ax.set_title(f"{lat}, working set {big:g}x VRAM cache", fontsize=9)
        ax.axhline(1.0, color="grey", linewidth=0.6)
    axes[0][0].set_ylabel("modelled time / uvm (log)")
    axes[0][-1].legend(fontsize=7, loc="lower right")
    fig.suptitle(f"GPU memory over CXL: normalised execution time (VRAM cache {vram >> 20} MiB; "
                 "scripts/bench gpumem)", fontsize=9)
    fig.tight_layout()
    for out in figure_paths(path):
        fig.savefig(out)
    plt.close(fig)


def figure_paths(path: str) -> list[str]:
    """``path`` and its twin in the other format (SVG and PNG)."""
    stem, ext = os.path.splitext(path)
    if ext.lower() not in (".svg", ".png"):
        raise SystemExit(f"scripts/bench gpumem: --figure {path}: give a .svg or .png path")
    return [path, stem + (".png" if ext.lower() == ".svg" else ".svg")]


def _size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(text.rstrip("KMG")) * mult


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="scripts/bench gpumem", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--vram", type=_size, default=4 << 20,
                        help="the uvm VRAM cache, the unit of the working-set sweep (default 4M: "
                             "two 2 MiB VA blocks, one per operand stencil and gemv touch at once)")
    parser.add_argument("--figure", default=None,
                        help="SVG or PNG path; the other format is written beside it "
                             "(default: gpumem.svg in the run directory)")
    parser.add_argument("--backend", choices=("type1", "iommufd"), default=None,
                        help="the guest's VFIO backend (iommufd needs --kernel lab)")
    add_kernel_option(parser)
    add_lab_option(parser, "single")
    args = parser.parse_args(argv)
    runs = plan(args.quick, args.vram)
    env = f"VFIO_CXL_VFIO_BACKEND={args.backend} " if args.backend else ""
    load = os.getloadavg()[0]
    t0 = time.monotonic()

    def boot():
        return Lab(topology.load("single"), kernel=guest_kernel(args), log=lambda *_: None)

    with booted_or_borrowed(args, "single", boot, command="scripts/bench gpumem", kernel=kernel_asked(args)) as lab:
        vm = lab["host0"]
        vm.run("vfio-cxl gpu bind")
        rows = json.loads(vm.run(f"{env}vfio-cxl-m vfio_cxl.guest.cmd.gpumem --plan -", stdin=json.dumps(runs),
                                 timeout=3600).stdout)
        speed = json.loads(vm.run(f"{env}vfio-cxl gpu run stream --mode cxl --working-set {SPEED_WS} --json",
                                  timeout=900).stdout)
    for p, r in zip(runs, rows):
        r["factor"] = p["factor"]
    speedups(rows)
    figure_path = args.figure or os.path.join(os.environ.get("VFIO_CXL_RUNDIR", "."), "gpumem.svg")
    figure(rows, figure_path, args.vram)
    result = {
        "model": {name: model.Model().with_profile(name).describe() for name in model.PROFILES},
        "runs": [{k: r[k] for k in ("kernel", "mode", "latency", "working_set", "vram", "factor", "unit",
                                    "warm", "modelled_ns", "wall_s", "verified", "counters",
                                    "speedup_vs_uvm", "vfio_backend")} for r in rows],
        "checks": checks(rows),
        "speed": {"kernel": "stream", "mode": "cxl", "working_set": speed["working_set"],
                  "wall_s": speed["wall_s"], "verified": speed["verified"], "target_s": 60,
                  "ok": speed["verified"] and speed["wall_s"] <= 60},
        "figure": figure_paths(figure_path), "load_average_1min": load, "bench_s": time.monotonic() - t0,
    }
    if args.json:
        print(json.dumps(result))
        return 0 if all(r["verified"] for r in rows) else 1
    report(result, args.vram)
    return 0 if all(r["verified"] for r in rows) else 1


def report(result: dict, vram: int) -> None:
    """The table, the checks and the lab's speed, as ``--json`` has them."""
    print(f"VRAM cache {vram >> 20} MiB (uvm, uvm-naive), unit 64K; model: docs/gpu-memory.md "
          f"(link {model.Model().link_gbps:g} GB/s, MLP {model.Model().mlp}, UVM fault batch "
          f"{model.Model().batch_ns / 1e3:g} us + PCIe {model.Model().pcie_gbps:g} GB/s); "
          f"host load {result['load_average_1min']:.2f}")
    print(f"{'kernel':8} {'ws':>7} {'latency':9} {'mode':14} {'modelled us':>12} {'vs uvm':>7} "
          f"{'far rd':>8} {'far wr':>8} {'sr hit':>7} {'faults':>6} {'batches':>7} {'wall s':>7} ok")
    for r in result["runs"]:
        c = r["counters"]
        hit = c["sr_hits"] / (c["sr_hits"] + c["far_lines_read"]) if c["sr_hits"] else 0
        vs = f"{r['speedup_vs_uvm']:.2f}" if r["speedup_vs_uvm"] else "-"
        print(f"{r['kernel']:8} {r['working_set'] >> 10:>6}K {r['latency']:9} "
              f"{r['mode'] + (' warm' if r['warm'] else ''):14} {r['modelled_ns'] / 1e3:>12.1f} {vs:>7} "
              f"{c['far_lines_read']:>8} {c['far_lines_written']:>8} {hit:>7.2f} {c['faults']:>6} "
              f"{c['fault_batches']:>7} {r['wall_s']:>7.2f} {'yes' if r['verified'] else 'NO'}")
    for c in result["checks"]:
        paper = f", paper {c['paper']}" if "paper" in c else ""
        print(f"{'PASS' if c['ok'] else 'FAIL'}  {c['check']}: {c['value']:.2f}{paper} (target {c['target']})")
    s = result["speed"]
    print(f"{'PASS' if s['ok'] else 'FAIL'}  lab speed: stream over {s['working_set'] >> 20} MiB in mode cxl: "
          f"{s['wall_s']:.1f} s wall (target <= 60 s), verified {s['verified']}")
    print(f"figure: {', '.join(result['figure'])}")
