"""Every command README.md and docs/*.md show, read from the docs themselves.

``documented()`` parses the Markdown: fenced ``sh`` blocks (every line a command), ``console``
blocks and untagged blocks (``$ CMD`` lines, with the output lines the doc shows under each;
in untagged blocks also synopsis lines that start with a command, joined with their ``[--opt]``
continuation lines), and inline code spans that start with a command (``vfio-cxl ...``,
``scripts/...``, ``./scripts/...``, ``python -m ...``, optionally after ``VFIO_CXL_X=Y``).

``CASES`` says how each one is run by ``tests/fast/test_documented_commands.py`` (no VM) or
``tests/vm/test_documented_commands.py`` (booted labs): as it is typed, with its smallest
arguments, covered by the run of another documented command (a synopsis and its concrete
form), or skipped with the reason.  A command that appears in the docs with no entry here
fails a fast test, naming the file and line.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMAND = re.compile(r"^(VFIO_CXL_\w+=\S+ )*(vfio-cxl |\./scripts/\S|scripts/\S|python3? -m )")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
COMMENT = re.compile(r"\s+(#|──).*$")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def program_and_output(doc: str, starts: str = "") -> tuple[str, str]:
    """A doc's complete program (its first ``python`` block whose text starts with ``starts``) and
    the output the page shows for it (the first untagged block after it), for the VM tests that
    run a documented program as typed."""
    text = (ROOT / doc).read_text()
    program = re.search(rf"^```python\n({re.escape(starts)}.*?)^```$", text, re.S | re.M)
    output = re.search(r"^```\n(.*?)^```$", text[program.end():], re.S | re.M)
    return program.group(1), output.group(1).strip()


def pager_blocks() -> tuple[str, str]:
    """docs/guest-library.md, "Your own pager": its pager class and its use, as the page shows
    them (run by tests/fast/test_gpumem_pager.py on the device model, tests/vm/test_gpumem.py in
    a guest)."""
    text = (ROOT / "docs/guest-library.md").read_text()
    section = text[text.index("## Your own pager"):]
    section = section[:section.index("\n## ", 1)]
    blocks = re.findall(r"^```python\n(.*?)^```$", section, re.S | re.M)
    (pager,) = [b for b in blocks if "class DirectMappedPager" in b]
    (use,) = [b for b in blocks if "GpuMemory.open()" in b]
    return pager, use


def normal(text: str) -> str:
    return " ".join(text.split())


@dataclass
class Shown:
    """One place a doc shows a command: where, and the output lines shown under it (console)."""
    command: str
    where: str
    output: list[str] = field(default_factory=list)
    block: str | None = None      # "README.md:441" for a command of a console session


def _block(lines: list[str], start: int, lang: str, name: str) -> list[Shown]:
    shown: list[Shown] = []
    where_block = f"{name}:{start}"
    for i, line in enumerate(lines, start + 1):
        stripped = line.strip()
        if lang == "sh":
            if stripped and not stripped.startswith("#"):
                shown.append(Shown(normal(COMMENT.sub("", stripped)), f"{name}:{i}"))
            continue
        if line.startswith("$ "):
            shown.append(Shown(normal(COMMENT.sub("", line[2:])), f"{name}:{i}", block=where_block))
        elif shown and shown[-1].block and not stripped.startswith("#"):
            if stripped:
                shown[-1].output.append(line.rstrip())
        elif lang == "" and COMMAND.match(line):
            shown.append(Shown(normal(COMMENT.sub("", line)), f"{name}:{i}"))
        elif lang == "" and shown and not shown[-1].block and re.match(r"\s+(\[|--)", line) \
                and shown[-1].where == f"{name}:{i - 1 - len(shown[-1].output)}":
            shown[-1].command = normal(shown[-1].command + " " + COMMENT.sub("", stripped))
            shown[-1].output.append("")   # keeps the line arithmetic above: one per joined line
    for s in shown:
        if not s.block:
            s.output = []
    return shown


def documented() -> list[Shown]:
    found: list[Shown] = []
    for path in doc_files():
        name = path.relative_to(ROOT).as_posix()
        lines = path.read_text().splitlines()
        prose = list(lines)                # fenced lines blanked: inline spans are read from prose
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if not m:
                i += 1
                continue
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
            indent = len(m.group(1))
            if m.group(2) in ("", "sh", "console"):
                found += _block([line[indent:] for line in lines[i + 1:end]], i + 1, m.group(2), name)
            for j in range(i, end + 1):
                prose[j] = ""
            i = end + 1
        text = "\n".join(prose)
        for span in re.finditer(r"`([^`]+)`", text):
            command = normal(span.group(1))
            if COMMAND.match(command + " ") and not command.endswith("/"):
                line = text.count("\n", 0, span.start()) + 1
                found.append(Shown(command, f"{name}:{line}"))
    return found


# ---------------------------------------------------------------------------------------------
# How each documented command is run.
#   run:   the command line run through bash from the repo root (default: as documented)
#   group: "fast" (tests/fast), or the VM session that runs it (tests/vm)
#   same:  covered by the run of that other documented command (a synopsis and its example)
#   skip:  not run, with the reason
#   xfail: run, known to fail, with the reason (reported)
#   until: a command that runs until Ctrl-C (a server, a lab in the foreground, --follow): the test
#          waits for a line matching it, sends SIGINT as Ctrl-C does, and expects a clean exit

@dataclass(frozen=True)
class Case:
    group: str = "fast"
    run: str | None = None
    same: str | None = None
    skip: str | None = None
    xfail: str | None = None
    expect: tuple[str, ...] = ()   # regexes some output line must match (beyond the doc's own)
    timeout: float = 120
    exit: int = 0                  # the exit status the docs promise
    files: tuple[tuple[str, str], ...] = ()   # (name, text) written into the cwd first
    until: str | None = None       # a server or a follower: once a line matches, Ctrl-C (SIGINT) it
    # group "borrowed": the (topology, kernel) of the running detached lab the command runs in,
    # typed as shown with $VFIO_CXL_LAB naming it (vfio_cxl/lab/borrow.py) rather than booting its own
    borrows: tuple[str, str | None] | None = None


def skip(reason: str) -> Case:
    return Case(group="-", skip=reason)


def same(command: str) -> Case:
    return Case(group="-", same=command)


READY = r"^READY "
LAB_KERNEL = "needs the lab kernel (vfio-cxl provision --kernel lab, ~700 CPU-s): run when it is cached"
CASES: dict[str, Case] = {}   # filled in below, one entry per documented command

SCRIPT_DEMO = "./scripts/demo"
# `vm up ./my.toml` as docs/topologies.md shows it: single.toml with a window granularity CXL lacks
BAD_TOPOLOGY = (ROOT / "qemu/topologies/single.toml").read_text().replace(
    'size = "4G"\n', 'size = "4G"\ngranularity = "3K"\n', 1)
CASES.update({
    # ---- no VM: tests/fast/test_documented_commands.py
    "./scripts/test --fast": skip("the fast suite itself: this test is part of it"),
    "./scripts/test --quick": skip("the fast suite and the smoke VM tests: all of them part of this suite "
                                   "(tests/fast/test_test_tiers.py checks the tier)"),
    "./scripts/test --soak": skip("the whole suite with the long repetitions: this test is part of it"),
    "./scripts/test": skip("the whole suite: this test is part of it"),
    "./scripts/test --durations=0": skip("the whole suite, every test's time listed: this test is part of it"),
    "VFIO_CXL_LAB_KERNEL=1 ./scripts/test": skip("the whole suite after building the lab kernel "
                                                 "(~700 CPU-s): this test is part of the suite"),
    "VFIO_CXL_TEST_KERNEL=debian ./scripts/test": skip("the whole suite with every lab on Debian's kernel: this test is "
                                                       "part of the suite (tests/fast/test_test_tiers.py checks the choice)"),
    "./scripts/test tests/vm/test_smc.py -s": skip("a VM test module of the suite, run by ./scripts/test"),
    "vfio-cxl vm topologies": Case(expect=(r"^single\s+\S",)),
    "vfio-cxl vm topology hb2": Case(expect=(r"hb2",)),
    "vfio-cxl vm topology hb2 --svg hb2.svg": Case(),
    "vfio-cxl vm topology TOPOLOGY [--svg F] [--png F]": Case(run="vfio-cxl vm topology single --png single.png"),
    "vfio-cxl vm topology NAME --svg": same("vfio-cxl vm topology hb2 --svg hb2.svg"),
    "scripts/draw-topologies": Case(expect=(r"^docs/topologies/single\.svg$",)),
    "vfio-cxl vm up hb2 --dry-run": Case(expect=(r"^qemu-system-x86_64 ",)),
    "vfio-cxl vm up TOPOLOGY [--dry-run] [--ssh-port N] [--no-gpu] [--run CMD]":
        Case(run="vfio-cxl vm up single --dry-run --ssh-port 40022 --no-gpu --run true",
             expect=(r"hostfwd=tcp:127\.0\.0\.1:40022-:22",)),
    "vfio-cxl vm up ./my.toml": Case(exit=1, files=(("my.toml", BAD_TOPOLOGY),)),   # the error docs/topologies.md shows
    "vfio-cxl gpu serve --socket PATH [--irq-mode msix|msi]":
        Case(run="vfio-cxl gpu serve --socket gpu.sock --irq-mode msi", until=READY),
    "vfio-cxl gpu serve --socket PATH [--vram-mib N] [--vendor-id 0x0601] [--device-id 0x1991] [--irq-mode msix|msi] "
    "[--message-timeout S] [--share-vram PATH] [--peer PATH ...] [--local-dma-faults] [-v]":
        Case(run="vfio-cxl gpu serve --socket gpu.sock --vram-mib 16 --vendor-id 0x0601 --device-id 0x1991 "
                 "--irq-mode msix --message-timeout 5 --share-vram vram.sock --local-dma-faults -v",
             until=READY),
    "vfio-cxl gpu serve": same("vfio-cxl gpu serve --socket PATH [--irq-mode msix|msi]"),
    "python -m vfio_cxl.devices.gpu serve ...": Case(run="python -m vfio_cxl.devices.gpu serve --socket gpu.sock", until=READY),
    "python -m vfio_cxl.devices.gpu serve": same("python -m vfio_cxl.devices.gpu serve ..."),
    "python -m vfio_cxl.devices.gpu serve --vram-mib N":
        Case(run="python -m vfio_cxl.devices.gpu serve --vram-mib 16 --socket gpu.sock", until=READY),
    "vfio-cxl smc serve --sockets DIR --hosts N": Case(run="vfio-cxl smc serve --sockets smc --hosts 2", until=READY),
    "vfio-cxl smc serve": same("vfio-cxl smc serve --sockets DIR --hosts N"),
    "scripts/bench chaos [--seconds N] [--seed S]": Case(run="scripts/bench chaos --seconds 3 --seed 1", timeout=180),
    "scripts/bench channel": Case(run="scripts/bench channel --records 8", timeout=300),
    "scripts/bench gpu-server": Case(run="scripts/bench gpu-server --size-mib 1 --runs 1 --latency-runs 1 "
                                         "--max-xfer-mib 1", timeout=300),
    "scripts/bench gpu-server --max-xfer-mib 1": Case(run="scripts/bench gpu-server --max-xfer-mib 1 --size-mib 1 "
                                                          "--runs 1 --latency-runs 1", timeout=300),
    "scripts/bench": Case(run="scripts/bench", exit=2, expect=(r"^usage: python -m vfio_cxl\.bench \{",)),
    "python -m vfio_cxl.guest.cacheline build": Case(),
    "python -m vfio_cxl.guest.cacheline bench": Case(timeout=300),
    # README.md's "Figures" still shows the module's old place at the package root (to be updated there).
    "python -m vfio_cxl.guest.cmd.stream … --coherence x86":
        skip("a guest program (the channel's producer/consumer over /dev/dax): run in the guests by "
             "demo share and scripts/bench share"),
    "python -m vfio_cxl.lab.fm serve --name … --logdir … --topology …":
        same("vfio-cxl vm up shared --detach"),   # what --detach starts; not a user command
    "python3 -m vfio_cxl.guest.cmd.cxltool regions":
        same("vfio-cxl vm up shared --detach"),   # the lab runs it in every guest at boot
    "vfio-cxl provision --kernel lab": Case(group="lab-kernel", skip=LAB_KERNEL),
    "vfio-cxl vm up single --kernel ~/linux/arch/x86/boot/bzImage [--modules DIR] [--append 'dyndbg=+p']":
        skip("your own kernel tree: a path on the user's machine (the lab-kernel form above is run)"),
    "vfio-cxl vm up TOPOLOGY [--detach] --qemu PATH":
        skip("your own QEMU build; the checks are tests/fast/test_user_qemu.py with fake binaries, and this "
             "machine has no QEMU build that runs outside the lab's tree"),
    "vfio-cxl demo --qemu PATH NAME": skip("your own QEMU build (see vm up --qemu PATH)"),
    "vfio-cxl gpu p2p": skip("not a command yet: the docs name it as what guest.p2p's run()/main() "
                             "would hook into"),
    "python3 -m vfio_cxl.guest.cmd.p2p [--from BDF] [--to BDF] [--size N] [--backend type1|iommufd]":
        same("vfio-cxl demo p2p"),   # the demo runs it in the guest
    # ---- VM: tests/vm/test_documented_commands.py, grouped by the lab they need
    SCRIPT_DEMO: Case(group="demo", timeout=1800,
                      expect=(r"^GPU → CXL: 'DMA FROM GPU TO CXL MEMORY' \+ \d+ bytes, \d+ bytes into "
                              r"/dev/dax0\.0 \(region0\) at offset 0x0$",
                              r"^guest checksum: MATCH \(sha256 \w+…\); host backend file: MATCH$",
                              r"^timings: DMA map [\d.]+ ms, doorbell→MSI-X [\d.]+ ms \(\d+ MB/s\), device \d+ µs; "
                              r"VFIO backend \w+$")),
    "vfio-cxl demo tour": same(SCRIPT_DEMO),      # ./scripts/demo runs these three lines as typed
    "vfio-cxl demo dma": same(SCRIPT_DEMO),
    "vfio-cxl demo share": same(SCRIPT_DEMO),
    "vfio-cxl demo dma [--size N] [--offset N]": Case(group="borrowed", borrows=("single", None),
                                                      run="vfio-cxl demo dma --size 65536 --offset 4096",
                                                      timeout=900, expect=(r"bytes into /dev/dax0\.0 \(region0\) at "
                                                                           r"offset 0x1000$",)),
    "vfio-cxl demo share [--records N]": same(SCRIPT_DEMO),
    "vfio-cxl demo p2p": Case(group="borrowed", borrows=("p2p", None), timeout=1800, expect=(r"^\s+host memcpy, cold \(reference\)\s+\d+ MB/s",)),
    "vfio-cxl demo p2p [--size N]": same("vfio-cxl demo p2p"),
    "scripts/boot-vm": Case(group="boot", timeout=900, until=r"^lab running; Ctrl-C stops it$"),
    "scripts/boot-shared": Case(group="boot", timeout=900, until=r"^lab running; Ctrl-C stops it$"),
    "vfio-cxl vm up single|shared": same("scripts/boot-vm"),
    "vfio-cxl vm up TOPOLOGY --detach": same("vfio-cxl vm up shared --detach"),
    "vfio-cxl vm up single --detach": same("vfio-cxl vm up shared --detach"),
    # the console session on `shared` (docs/fabric-manager.md, "A detached lab, as a user types it"), in order
    "vfio-cxl vm up shared --detach": Case(group="detached", timeout=900),
    "vfio-cxl vm ls": Case(group="detached"),
    "vfio-cxl fm status": Case(group="detached"),
    'vfio-cxl vm ssh a -- python3 -m vfio_cxl.guest.cmd.demo_dma; echo "exit=$?"': Case(group="detached", timeout=600),
    "vfio-cxl vm ssh b": Case(group="detached", timeout=600),   # a shell in b: the test types into it
    "vfio-cxl fm events --follow": Case(group="detached", until=r"\bvm-died\b"),
    "vfio-cxl vm down": Case(group="detached", timeout=300),
    # README's console session on `fabric` ("Fabric manager: labs that stay up, and GPUs that move"), in order
    "vfio-cxl vm up fabric --detach": Case(group="fabric", timeout=900),
    "vfio-cxl vm ssh a -- vfio-cxl gpu ls": Case(group="fabric", timeout=600),
    "vfio-cxl vm ssh a -- vfio-cxl gpu dma": Case(group="fabric", timeout=600),
    "vfio-cxl fm assign gpu0 b": Case(group="fabric", timeout=600),
    "vfio-cxl vm ssh b -- vfio-cxl gpu ls": Case(group="fabric", timeout=600),
    "vfio-cxl fm assign gpu0 a --keep-vram": Case(group="fabric", timeout=600),
    "vfio-cxl fm release gpu0": Case(group="fabric", timeout=600),
    "vfio-cxl fm restart gpu0": Case(group="fabric", timeout=600),
    "vfio-cxl gpu ls": same("vfio-cxl vm ssh a -- vfio-cxl gpu ls"),
    "vfio-cxl gpu holders --gpu BDF": Case(group="fabric", run="vfio-cxl vm ssh a -- vfio-cxl gpu holders --gpu {bdf}",
                                           timeout=600),
    # kernels
    "vfio-cxl vm up single --kernel lab --run 'vfio-cxl gpu ls; vfio-cxl gpu dma --size 16M'":
        Case(group="lab-kernel", skip=LAB_KERNEL, timeout=900),
    "vfio-cxl demo dma --kernel lab --vfio-backend iommufd": Case(group="lab-kernel", skip=LAB_KERNEL, timeout=900),
    "vfio-cxl selftest vfio [--kernel lab|PATH] [--backend type1|iommufd|all] [-k FILTER] [--json]":
        Case(group="borrowed", borrows=("selftest", None),
             run="vfio-cxl selftest vfio --backend type1 -k vfio_pci_device_test --json", timeout=1800,
             expect=(r'^ "passed": [1-9]\d*,$', r'^ "failed": 0,$')),
    "vfio-cxl selftest vfio": skip("every test on every mode: 13 min warm on this machine; its smallest form "
                                   "(--backend type1 -k vfio_pci_device_test) is run"),
    "vfio-cxl selftest vfio --kernel lab": skip("every test on every mode on the lab kernel: 13 min warm, "
                                                "32 min cold; " + LAB_KERNEL),
    "vfio-cxl selftest vfio --kernel lab --json": skip("as `selftest vfio --kernel lab`, as JSON"),
    "vfio-cxl selftest vfio --kernel lab --backend iommufd -k '*mix_and_match' --json":
        Case(group="lab-kernel", skip=LAB_KERNEL, timeout=1800),
    # benchmarks: each with its smallest arguments (each boots its own lab, or borrows the session's)
    "scripts/bench boot": Case(group="bench", run="scripts/bench boot --runs 1 --kernel debian --json", timeout=900,
                               expect=(r'^ "rows": \[',)),   # --json: the table goes to stderr, so both run
    "scripts/bench guest-start": Case(group="borrowed", borrows=("single", None), run="scripts/bench guest-start --runs 1",
                                      timeout=900, expect=(r"^vfio-cxl gpu ls +\d",)),
    "scripts/bench boot --runs 12 --kernel lab --kernel debian":
        Case(group="lab-kernel", skip=LAB_KERNEL, run="scripts/bench boot --runs 1 --kernel lab --kernel debian",
             timeout=900, expect=(r"^single +lab +1 ", r"^single +debian +1 ")),
    "scripts/bench fabric --moves 6": same("scripts/bench fabric"),
    "scripts/bench routes": same("VFIO_CXL_LAB=single-1 scripts/bench routes"),
    # the README's borrowing example: {lab} is the session's lab of that topology
    "VFIO_CXL_LAB=single-1 scripts/bench routes": Case(group="borrowed", borrows=("single", None), timeout=900,
                                                       run="VFIO_CXL_LAB={lab} scripts/bench routes --sizes 1M --runs 1"),
    "scripts/bench share": Case(group="bench", run="scripts/bench share --records 0 --plan 64:2:paced", timeout=1200),
    "scripts/bench share --records 0 --json": same("scripts/bench share"),
    "scripts/bench supervision": Case(group="bench", timeout=900),
    "scripts/bench p2p": Case(group="borrowed", borrows=("p2p", None), run="scripts/bench p2p --size 1M", timeout=1200),
    "scripts/bench fabric": Case(group="bench", run="scripts/bench fabric --moves 1", timeout=900),
    "scripts/bench matrix-node": Case(group="bench", timeout=600,
                                      expect=(r"^ray start \(head: .*\d+\.\d s +\d+\.\d s$",
                                              r"^artefacts each node builds")),
})


# GPU memory over CXL, storage, the matrix, Redfish, the pytest plugin, the FM fuzzer
GPUMEM_TEST = "run as typed in the guest by tests/vm/test_gpumem.py::"
STORAGE_TEST = "run in the guest by tests/vm/test_storage.py::"
MATRIX_EXAMPLE = (ROOT / "docs/matrix-example.toml").read_text()
CASES.update({
    "vfio-cxl gpu run stencil --mode cxl+sr+ds --latency cxl-80ns --working-set 1M":
        skip(GPUMEM_TEST + "test_the_readme_commands (a guest command: the lab's single VM runs it)"),
    "vfio-cxl gpu run stream --mode uvm-naive --working-set 1M --vram-cache 256K --unit 64K":
        skip(GPUMEM_TEST + "test_the_readme_commands"),
    "vfio-cxl gpu run stream --mode uvm --working-set 8M --vram-cache 2M --unit 64K":
        skip(GPUMEM_TEST + "test_uvm_batches_prefetches_and_evicts_2mib_blocks"),
    "vfio-cxl gpu run gemv --mode cxl+sr+ds --working-set 8M":
        skip(GPUMEM_TEST + "test_every_kernel_in_every_mode_verifies (gemv among every kernel x mode)"),
    "vfio-cxl gpu run stream --mode cxl+sr --working-set 8M":
        skip(GPUMEM_TEST + "test_every_kernel_in_every_mode_verifies (every kernel x mode at a small size)"),
    "vfio-cxl gpu run": same("vfio-cxl gpu run stencil --mode cxl+sr+ds --latency cxl-80ns --working-set 1M"),
    "vfio-cxl gpu run KERNEL --mode uvm|uvm-naive|cxl|cxl+sr|cxl+ds|cxl+sr+ds --latency cxl-80ns|cxl-250ns|ssd "
    "--working-set SIZE [--vram-cache SIZE] [--unit 4K|64K|2M] [--warm] [--json]":
        same("vfio-cxl gpu run stencil --mode cxl+sr+ds --latency cxl-80ns --working-set 1M"),
    "scripts/bench gpumem --quick": Case(group="borrowed", borrows=("single", None), timeout=1800,
                                         expect=(r"stream.*cxl-80ns.*cxl\+sr\+ds", )),
    "scripts/bench gpumem": skip("the full sweep (working set 0.5x-8x, every kernel, mode and latency): "
                                 "its --quick form is run"),
    "scripts/bench gpumem [--quick] [--json] [--figure PATH] (host: boots `single`)": same("scripts/bench gpumem --quick"),
    "scripts/bench gpumem --json": same("scripts/bench gpumem"),
    "scripts/bench gpumem --quick --json": same("scripts/bench gpumem --quick"),
    # one run of the quick sweep (several minutes) with every option the docs show but --kernel lab
    "scripts/bench storage --quick": Case(group="bench", timeout=2400,
                                          run="scripts/bench storage --quick --bounce-buffer 16M --json",
                                          expect=(r'"bounce_buffer": 16777216', )),
    "scripts/bench storage --quick --kernel lab": same("scripts/bench storage --quick"),
    "scripts/bench storage --quick --kernel lab --json": same("scripts/bench storage --quick"),
    "scripts/bench storage --quick --kernel lab --bounce-buffer 16M --json": same("scripts/bench storage --quick"),
    "scripts/bench storage --quick --kernel lab --bounce-buffer 64K": same("scripts/bench storage --quick"),
    "scripts/bench storage --quick --kernel lab --bounce-buffer 4K": same("scripts/bench storage --quick"),
    "scripts/bench storage": skip("the full sweep (4 KiB-1 MiB x queue depth 1-64 on every path): "
                                  "its --quick form is run"),
    "vfio-cxl nvme ls|identify|read|write": same("vfio-cxl nvme ls"),
    "vfio-cxl nvme": same("vfio-cxl nvme ls"),
    "vfio-cxl nvme ls": skip(STORAGE_TEST + "test_bring_up_and_identify_type1 (a guest command, with --json)"),
    "vfio-cxl nvme identify --nvme 0000:04:00.0 --json": skip(STORAGE_TEST + "test_bring_up_and_identify_type1 "
                                                             "(the BDF comes from nvme ls)"),
    "vfio-cxl nvme write --nvme 0000:04:00.0 --offset 8M --pattern 7 --length 1M --json":
        skip(STORAGE_TEST + "test_round_trip_through_guest_ram_type1"),
    "vfio-cxl nvme read --nvme 0000:04:00.0 --offset 8M --length 1M --sgl --json":
        skip(STORAGE_TEST + "test_round_trip_through_guest_ram_type1"),
    # the NIC (docs/nic.md): group "nic", run as typed in the guests of nic2 by tests/vm/test_nic.py
    # (recv on host1, send on host0, ls and stats on both)
    "vfio-cxl nic ls": Case(group="nic", timeout=600),
    "vfio-cxl nic recv --queue 1 --steer 02:00:00:00:01:01 --count 8 --seed 7 --timeout 60 "
    "--ready-file /tmp/nic-ready":
        Case(group="nic", timeout=600),
    "vfio-cxl nic send --to 02:00:00:00:01:01 --count 8 --size 1024 --seed 7": Case(group="nic", timeout=600),
    "vfio-cxl nic recv --queue 1 --steer 02:00:00:00:01:01 --gpu --count 8 --seed 7 --timeout 60 "
    "--ready-file /tmp/nic-ready":
        Case(group="nic", timeout=600),
    "vfio-cxl nic stats": Case(group="nic", timeout=600),
    "vfio-cxl nic rdma-recv --length 16M --seed 5 --ready-file /tmp/nic-ready": Case(group="nic", timeout=900),
    "vfio-cxl nic rdma-write --to 52:54:00:1e:02:00 --key 0x100 --sizes 16M --seed 5": Case(group="nic", timeout=900),
    "vfio-cxl nic ls|stats|send|recv|rdma-recv|rdma-write": same("vfio-cxl nic ls"),
    "vfio-cxl nic ls|stats|send|recv": same("vfio-cxl nic ls"),
    "scripts/bench nic --quick": Case(group="borrowed", borrows=("nic2", None), run="scripts/bench nic --sizes 64K --json", timeout=2400),
    "scripts/bench nic": same("scripts/bench nic --quick"),
    "scripts/bench boot [--topology NAME | --all] | gpu-server | routes | share | supervision | channel | storage":
        same("scripts/bench boot"),
    "scripts/bench fm-fuzz [--requests N] [--seed S] [--json]":
        Case(run="scripts/bench fm-fuzz --requests 300 --seed 1", timeout=600),
    "scripts/bench fm-fuzz --lab [NAME] [--requests N] [--seed S] [--json]":
        Case(group="bench", timeout=1200,
             run="vfio-cxl vm up single --detach && scripts/bench fm-fuzz --lab --requests 300 --seed 1; s=$?; "
                 "vfio-cxl vm down; exit $s",
             expect=(r"^fm-fuzz: the FM stayed up and answered every line, and every VM of lab single-\d+ answers SSH$",
                     r"^  after the fuzz, vm ssh -- true: host0 [\d.]+ s$")),
    "vfio-cxl vm up single --detach && scripts/bench fm-fuzz --lab --requests 10000 --seed 23; vfio-cxl vm down":
        skip("10,000 requests against a booted lab: the same line with --requests 300 runs as the "
             "synopsis' case"),
    "scripts/bench fm-fuzz --requests 10000 --seed 23": skip("10,000 requests (~90 s idle): the fast test "
                                                             "runs it with --requests 300, tests/fast/test_fm_hostile.py 600"),
    # run as typed by tests/vm/test_matrix.py (the two-node test's local run), not again here
    "vfio-cxl matrix run docs/matrix-example.toml --junit junit.xml --kcidb kcidb.json":
        Case(group="matrix", timeout=2400, files=(("docs/matrix-example.toml", MATRIX_EXAMPLE),)),
    "vfio-cxl matrix run FILE [--address auto|HOST:PORT] [--junit F] [--kcidb F] [--json]":
        Case(run="vfio-cxl matrix run docs/matrix-example.toml --dry-run",
             files=(("docs/matrix-example.toml", MATRIX_EXAMPLE),), expect=(r"^uname kernel=debian topology=single",)),
    "vfio-cxl matrix run FILE [--address auto|HOST:PORT] [--max-parallel N] [--provision] [--junit F] [--kcidb F] "
    "[--origin NAME] [--json] [--out DIR] [--dry-run]":
        same("vfio-cxl matrix run FILE [--address auto|HOST:PORT] [--junit F] [--kcidb F] [--json]"),
    "vfio-cxl matrix run FILE": same("vfio-cxl matrix run FILE [--address auto|HOST:PORT] [--junit F] [--kcidb F] [--json]"),
    "vfio-cxl matrix run": same("vfio-cxl matrix run FILE [--address auto|HOST:PORT] [--junit F] [--kcidb F] [--json]"),
    ".venv/bin/pip install -e '.[matrix]'": skip("installs the extra into the checkout's venv: ./scripts/test "
                                                "installs it (the test extra includes it)"),
    "pip install 'vfio-cxl[matrix]'": skip("the same extra from an index: ./scripts/test installs it from the checkout"),
    ".venv/bin/ray start --head --port 6379 --num-cpus 8 --resources '{\"tcg_vm\": 4}'":
        skip("cluster set-up on N machines (8 CPUs a node); tests/vm/test_matrix.py starts a head and a worker"),
    ".venv/bin/ray start --address HEAD:6379 --num-cpus 8 --resources '{\"tcg_vm\": 4}'":
        skip("cluster set-up on N machines: HEAD is another machine"),
    ".venv/bin/vfio-cxl matrix run docs/matrix-example.toml --address HEAD:6379 --junit junit.xml --kcidb kcidb.json":
        skip("a cluster of N machines: HEAD is another machine (the local form is run)"),
    ".venv/bin/ray stop": skip("cluster set-up on N machines"),
    "vfio-cxl selftest vfio --kernel K --backend B [-k F]...": skip("what a matrix job of kind selftest runs: "
                                                                   "the selftest synopsis is run"),
    "python -m pytest SELECT... [-k K]": skip("what a matrix job of kind pytest runs (the suite itself)"),
    "python -m vfio_cxl.bench NAME ARGS...": skip("what a matrix job of kind bench runs: each bench is run "
                                                  "with its smallest arguments"),
    "vfio-cxl provision": skip("the README's commands run it (./scripts/test and ./scripts/demo provision first)"),
    "vfio-cxl provision --refresh-lab-kernel": skip("./scripts/test runs it as typed before every run (.ci/run)"),
    "vfio-cxl vm up": same("vfio-cxl vm up shared --detach"),
    "python -m vfio_cxl.matrix.node": skip("the node-side entry point a matrix job runs on a Ray node "
                                           "(tests/fast/test_matrix.py runs its supervisor on real processes)"),
    "python -m venv .venv && .venv/bin/pip install path/to/vfio-cxl pytest":
        skip("a user's project: tests/vm/test_pytest_plugin.py makes that venv and runs the doc's example test"),
    ".venv/bin/vfio-cxl provision": same("vfio-cxl provision"),
    ".venv/bin/python -m pytest -s tests/": skip("a user's project: tests/vm/test_pytest_plugin.py runs it"),
    "vfio-cxl fm redfish [--lab L] [--port N] [--stop]": same("vfio-cxl fm redfish"),
    "vfio-cxl fm redfish [--lab L] [--port N]": same("vfio-cxl fm redfish"),
    "vfio-cxl fm redfish": skip("tests/vm/test_redfish.py starts it as a user would on a fabric lab, and "
                                "tests/fast/test_redfish.py::test_fm_redfish_serves_moves_delivers_and_stops_with_the_lab "
                                "on the fake lab"),
    "vfio-cxl fm redfish --stop": same("vfio-cxl fm redfish"),
    "curl -s http://127.0.0.1:41237/redfish/v1/Fabrics/CXL/Connections":
        skip("the port is the one `fm redfish` printed; tests/vm/test_redfish.py GETs the same URL with DMTF's client"),
    "vfio-cxl gpu dma": same("vfio-cxl vm ssh a -- vfio-cxl gpu dma"),
})
# A synopsis whose concrete form is run elsewhere (a guest command, a user's project) says where, too.
for _command, _case in list(CASES.items()):
    if _case.same and CASES[_case.same].skip:
        CASES[_command] = skip(CASES[_case.same].skip)


# ---------------------------------------------------------------------------------------------
# Running a documented command as a user types it, and checking the lines the docs show.

def shown_pattern(line: str) -> re.Pattern:
    """A line a doc shows, as a pattern for the line the command prints: what varies from run to
    run (numbers, pids, ports, times, names with digits, paths, an elided "…") may differ; every
    word and the order of the words must be as shown."""
    parts = []
    for token in line.split():
        if "/" in token:
            parts.append(r"\S+")
            continue
        pieces = ["".join(r"\w+" if re.search(r"[0-9]", run) else re.escape(run)
                          for run in re.split(r"([0-9A-Za-z]+)", piece) if run)
                  for piece in token.split("…")]
        parts.append(".*".join(pieces))
    return re.compile(r"\s*" + r"\s+".join(parts) + r"\s*")


def unmatched(shown: list[str], printed: list[str]) -> list[str]:
    """The shown lines no printed line matches, in order (the printed lines may have more between)."""
    missing, at = [], 0
    for line in shown:
        pattern = shown_pattern(line)
        hit = next((i for i in range(at, len(printed)) if pattern.fullmatch(printed[i])), None)
        if hit is None:
            missing.append(line)
        else:
            at = hit + 1
    return missing


def environment() -> dict[str, str]:
    """The user's shell after the README's setup: the checkout's venv first on PATH."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("PYTHONPATH", None)
    return env


def cwd_for(command: str, scratch: Path) -> Path:
    """A command line that runs ``scripts/...`` (first, or after ``&&``) from the repo root, as the
    README runs them; anything else from a scratch directory (so files a command writes,
    ``--svg hb2.svg``, a socket, land there)."""
    return ROOT if any(word.startswith(("scripts/", "./scripts/")) for word in command.split()) else scratch


@dataclass
class Ran:
    command: str
    returncode: int | None
    lines: list[str]        # stderr then stdout, or merged in order for a command run until Ctrl-C
    stdout: str
    seconds: float

    def describe(self) -> str:
        tail = "\n".join(self.lines[-40:])
        return f"$ {self.command}\n(exit {self.returncode}, {self.seconds:.1f} s)\n{tail}"


def run(command: str, case: Case, cwd: Path, stdin: str | None = None, env: dict | None = None) -> Ran:
    """``bash -c COMMAND`` in its own session, as a terminal runs it, with ``env`` added to the
    user's environment.  A command with ``until`` runs until a line matches, then gets SIGINT on
    its process group (Ctrl-C)."""
    for name, text in case.files:
        (cwd / name).parent.mkdir(parents=True, exist_ok=True)
        (cwd / name).write_text(text)
    t0 = time.monotonic()
    if case.until is None:
        try:
            done = subprocess.run(["bash", "-c", command], cwd=cwd, env={**environment(), **(env or {})},
                                  input=stdin or "",
                                  capture_output=True, text=True, timeout=case.timeout, start_new_session=True)
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            raise AssertionError(f"$ {command}: no exit within {case.timeout:.0f} s\n{out[-3000:]}") from None
        return Ran(command, done.returncode, done.stderr.splitlines() + done.stdout.splitlines(), done.stdout,
                   time.monotonic() - t0)
    # As in a terminal's foreground: SIGINT at its default even when this test runs as a background
    # job (which starts with SIGINT ignored, and bash cannot trap a signal ignored on entry).
    proc = subprocess.Popen(["bash", "-c", command], cwd=cwd, env={**environment(), **(env or {})},
                            stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: queue.Queue[str | None] = queue.Queue()

    def reader() -> None:
        for line in proc.stdout:
            lines.put(line.rstrip("\n"))
        lines.put(None)

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    seen: list[str] = []
    deadline = time.monotonic() + case.timeout
    try:
        until = re.compile(case.until)
        while not any(until.search(line) for line in seen[-1:]):
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"$ {command}: no line matching {case.until!r} within {case.timeout:.0f} s\n"
                                     + "\n".join(seen[-40:])) from None
            if line is None:
                break
            seen.append(line)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)       # Ctrl-C: the terminal signals the foreground group
        try:
            returncode = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            # Where it hangs: vfio-cxl's faulthandler prints every thread's stack on SIGABRT.
            returncode = None
            os.killpg(proc.pid, signal.SIGABRT)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        thread.join(timeout=10)
        while True:
            try:
                line = lines.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                seen.append(line)
        proc.stdout.close()
    if returncode is None:
        raise AssertionError(f"$ {command}: still running 120 s after Ctrl-C; its output, then its "
                             "threads' stacks (SIGABRT):\n" + "\n".join(seen[-80:]))
    return Ran(command, returncode, seen, "\n".join(seen), time.monotonic() - t0)


def check(ran: Ran, case: Case, shown: list[str] = (), interrupted_ok: bool = True) -> None:
    """Exit status as the docs promise (Ctrl-C'd: 0, or 130 for a shell-level interrupt), every
    line the docs show under it, and the case's own expectations."""
    expected = {case.exit} | ({130, -signal.SIGINT} if case.until and interrupted_ok else set())
    assert ran.returncode in expected, f"exit {ran.returncode}, expected {case.exit}\n{ran.describe()}"
    assert not any("Traceback (most recent call last)" in line for line in ran.lines), ran.describe()
    missing = unmatched(list(shown), ran.lines)
    assert not missing, f"lines the docs show that it did not print: {missing}\n{ran.describe()}"
    for expect in case.expect:
        assert any(re.search(expect, line) for line in ran.lines), f"no line matches {expect!r}\n{ran.describe()}"
