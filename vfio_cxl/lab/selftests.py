"""The kernel's own VFIO selftests in the lab (``vfio-cxl selftest vfio``).

    build = build_selftests()                       # cached per source version and recipe
    plan = Plan.make(build, backends="all", filters=["driver"])
    results = run(lab, "host0", build, plan, logdir)  # on a running lab, e.g. topology "selftest"

**Build.**  ``tools/testing/selftests/vfio`` of the lab kernel's source (the tree
``vfio-cxl provision --kernel lab`` unpacks) is built into
``<cache>/selftests/vfio-<source version>-<hash>/``: ``make headers`` out of
tree (once per source version, ``headers-<version>/``), the few parts of the tree the selftests read copied beside them (the
drivers include headers of drivers/dma and drivers/net through symlinks),
then ``selftests/vfio-gpu/Makefile``: the selftests' own Makefile with the
GPU driver linked in, static binaries (the guest has no toolchain), and each
test's case list (``<test>.cases``, from ``lister.c``).  The hash covers the
recipe below and the sources of ``selftests/vfio-gpu`` (C files, headers, Makefile).

**Run.**  The static binaries are copied into the guest over SSH, the devices
bound to vfio-pci (``vfio_cxl.guest.cmd.selftest``), and every test runs on every
device and IOMMU mode it applies to: tests with per-mode variants once per
device with ``-r`` for the chosen cases; tests on the library's default mode
(vfio_pci_device_test) once per mode with ``$VFIO_SELFTESTS_IOMMU_MODE``
(selftests/vfio-gpu/lab.c); vfio_iommufd_setup_test on ``iommufd`` (it is the
cdev's own test).  The harness's TAP output is parsed per case and kept as
one log per run in ``logdir``.

**Results.**  pass, fail, skip (with the test's reason), ``needs IOMMUFD``
(an iommufd mode on a kernel without /dev/iommu: the case fails at setup), and
``kernel difference`` (a known difference between the kernel the selftests
come from and the guest's, listed in KNOWN_DIFFERENCES, each with its reason
and only where its failure is exactly that one), ``lab limit`` (cases the lab
cannot run on a kind of device, listed in LAB_LIMITS with the reason; not
run).  Only passes count as passed; only fails as failed.
"""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import LabError
from ..paths import REPO_ROOT, cache_root
from .apt import clean_host_env
from .recipe import Progress, building, recipe_hash

DRIVER_DIR = REPO_ROOT / "selftests" / "vfio-gpu"
MODES = ("vfio_type1_iommu", "vfio_type1v2_iommu", "iommufd_compat_type1", "iommufd_compat_type1v2", "iommufd")
BACKENDS = {"type1": MODES[:2], "iommufd": MODES[2:], "all": MODES}
IOMMUFD_MODES = frozenset(MODES[2:])
GPU_PCI_ID = "0601:1991"          # docs/gpu-device.md
GUEST_DIR = "/root/vfio-selftests"
RECIPE = {
    "format": 1,
    "selftests": "tools/testing/selftests/vfio",
    "static": True,
    # what the selftests read of the kernel tree, besides 'make headers' (symlinks inside
    # are followed into the tree: e.g. lib/drivers/ioat/hw.h -> drivers/dma/ioat/hw.h)
    "copy": ["tools/testing/selftests/vfio", "tools/testing/selftests/kselftest",
             "tools/testing/selftests/kselftest.h", "tools/testing/selftests/kselftest_harness.h",
             "tools/testing/selftests/lib.mk", "tools/include", "tools/arch/x86/include",
             "scripts/subarch.include"],
    # The harness's per-case timeouts (30 s, or TEST_F_TIMEOUT's) are for hardware; under TCG on
    # a loaded host vfio_pci_driver_test's setup alone (pinning and IOMMU-mapping 1 GiB) can
    # take most of 30 s.  The build's copy of kselftest_harness.h multiplies them by this.
    "timeout_scale": 4,
}
HARNESS = "tools/testing/selftests/kselftest_harness.h"
HARNESS_WAIT = "poll(&poll_child, 1, t->timeout * 1000)"

# Results, and what each means in the table.
PASS, FAIL, SKIP, NEEDS_IOMMUFD, KERNEL_DIFFERENCE, LAB_LIMIT = (
    "pass", "fail", "skip", "needs IOMMUFD", "kernel difference", "lab limit")
RESULTS = (PASS, FAIL, SKIP, NEEDS_IOMMUFD, KERNEL_DIFFERENCE, LAB_LIMIT)


@dataclass(frozen=True)
class KnownDifference:
    """A case that fails on some guest kernels because the kernel behaves differently from the
    one the selftests were written for (not a lab bug): reported as such, never as a pass."""

    test: str
    case: str
    below: tuple[int, int]          # guest kernels older than this (major, minor)
    evidence: str                   # regex the case's log must match, so nothing else hides here
    why: str


KNOWN_DIFFERENCES = (
    KnownDifference("vfio_dma_mapping_test", "vfio_dma_map_limit_test.overflow", (7, 0),
                    r"\(-22\)",
                    "a DMA map/unmap whose IOVA range wraps past 2^64 returns EINVAL on 6.x; the "
                    "selftests (7.x) expect EOVERFLOW"),
)


@dataclass(frozen=True)
class LabLimit:
    """Cases the lab cannot run on a kind of device, and why: not run (they would hang the
    device for the cases after them), reported as such, never as a pass."""

    test: str
    mode: str
    device: str                     # the pci id of the devices it concerns
    why: str


# None at present.  (vfio_pci_driver_test on the GPU in iommufd_compat_type1 was one: iommufd's
# type1 v1 compat maps without huge pages, so its 1 GiB region reaches the vfio-user GPU as 262144
# 4 KiB DMA_MAPs, each with the guest-RAM fd; the server kept an mmap -- and so an fd -- per
# mapping and ran out of fds.  It now keeps one per client file: docs/kernels.md.)
LAB_LIMITS: tuple[LabLimit, ...] = ()


@dataclass(frozen=True)
class Case:
    test: str
    fixture: str
    variant: str
    name: str
    timeout: int

    @property
    def harness_name(self) -> str:
        """How the kselftest harness names it (TAP lines, ``-r``)."""
        return ".".join(p for p in (self.fixture, self.variant, self.name) if p)

    @property
    def mode(self) -> str | None:
        """The IOMMU mode of a per-mode variant, or None (the case uses the default mode)."""
        for mode in sorted(MODES, key=len, reverse=True):
            if self.variant == mode or self.variant.startswith(mode + "_"):
                return mode
        return None

    @property
    def label(self) -> str:
        """Fixture (when it is not the test's own), variant without its mode, test."""
        variant = self.variant
        if self.mode:
            variant = variant[len(self.mode):].lstrip("_")
        fixture = "" if self.fixture == self.test else self.fixture
        return ".".join(p for p in (fixture, variant, self.name) if p)


@dataclass
class Build:
    path: Path
    version: str
    cases: dict[str, list[Case]]
    seconds: float = 0.0
    cached: bool = True

    @property
    def tests(self) -> list[str]:
        return sorted(self.cases)


@dataclass
class Result:
    test: str
    case: str
    device: str
    backend: str
    result: str
    note: str = ""


# ------------------------------------------------------------------ build

def _copy_tree(src: Path, tree: Path) -> None:
    for rel in RECIPE["copy"]:
        source, dest = src / rel, tree / rel
        if not source.exists():
            raise LabError(f"the kernel source {src} has no {rel}",
                           "the VFIO selftests need a kernel source of 6.18 or newer (linux-source-7.x)")
        dest.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, dest, symlinks=True)
        else:
            shutil.copy2(source, dest, follow_symlinks=False)
    # Symlinks into the rest of the kernel tree: copy what they point at.
    for _ in range(3):
        dangling = [p for p in tree.rglob("*") if p.is_symlink() and not p.exists()]
        if not dangling:
            return
        for link in dangling:
            target = (link.parent / link.readlink()).resolve().relative_to(tree.resolve())
            origin = src / target
            if not origin.exists():
                raise LabError(f"{link.relative_to(tree)} points at {target}, which {src} does not have",
                               "use a complete kernel source tree")
            (tree / target).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(origin, tree / target)
    raise LabError("symlinks in the VFIO selftests do not resolve", f"see {tree}")


def _scale_timeouts(tree: Path) -> None:
    """In the build's copy of the harness (never the source tree): wait ``timeout_scale`` times
    as long for each case as the test asks."""
    harness = tree / HARNESS
    text = harness.read_text()
    if text.count(HARNESS_WAIT) != 1:
        raise LabError(f"{HARNESS} no longer waits for a case with '{HARNESS_WAIT}'",
                       "update HARNESS_WAIT in vfio_cxl/lab/selftests.py for this kernel source")
    harness.unlink()   # a copy: the source tree's file stays as it is
    harness.write_text(text.replace(HARNESS_WAIT, HARNESS_WAIT.replace(
        "t->timeout * 1000", f"t->timeout * 1000 * {RECIPE['timeout_scale']} /* vfio-cxl: TCG */")))


def _run(cmd: list[str], log: Path, what: str) -> None:
    with open(log, "a") as out:
        out.write(f"$ {shlex.join(cmd)}\n")
        out.flush()
        done = subprocess.run(["nice", "-n", "19", *cmd], stdout=out, stderr=subprocess.STDOUT,
                              env=clean_host_env())
    if done.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        raise LabError(f"building the VFIO selftests failed at {what}:\n{tail}", f"the whole log is {log}")


def selftests_root() -> Path:
    root = cache_root() / "selftests"
    root.mkdir(parents=True, exist_ok=True)
    return root


def _key(version: str) -> str:
    if not DRIVER_DIR.is_dir():
        raise LabError(f"the GPU's VFIO selftests driver is not here ({DRIVER_DIR}): it is GPL-2.0-only C that "
                       "ships with the source, not in the vfio-cxl wheel",
                       "run vfio-cxl selftest from a source checkout (pip install -e CHECKOUT)")
    files = sorted(p for p in DRIVER_DIR.iterdir() if p.suffix in (".c", ".h") or p.name == "Makefile")
    return f"vfio-{version}-{recipe_hash(RECIPE, *files)}"


def read_cases(path: Path) -> dict[str, list[Case]]:
    cases: dict[str, list[Case]] = {}
    for listing in sorted(path.glob("*.cases")):
        test = listing.stem
        rows = [line.split("\t") for line in listing.read_text().splitlines() if line]
        cases[test] = [Case(test, f, v, n, int(t)) for f, v, n, t in rows]
    return cases


def build_selftests(provision: bool = True, log=print) -> Build:
    """The VFIO selftests built from the lab kernel's source: cached, else built now."""
    from .kernel import lab_source   # the kernel module's download and unpack

    version, src = lab_source(provision, log)
    dest = selftests_root() / _key(version)
    if (dest / "manifest.json").is_file():
        manifest = json.loads((dest / "manifest.json").read_text())
        return Build(dest, version, read_cases(dest), manifest["build_seconds"], cached=True)
    if not (src / "tools/testing/selftests/vfio/Makefile").is_file():
        raise LabError(f"the kernel source {src} has no tools/testing/selftests/vfio",
                       "the VFIO selftests need a kernel source of 6.18 or newer (linux-source-7.x)")
    progress = Progress("selftests", log)
    started = time.monotonic()
    headers = selftests_root() / f"headers-{version}"   # 'make headers': per source version only
    if not (headers / "include" / "linux" / "vfio.h").is_file():
        with building(headers) as out:
            progress.step(f"make headers of {src.name} (log: {headers}/build.log)")
            _run(["make", "-s", "-C", str(src), f"O={out / 'obj'}", "ARCH=x86", "headers"], out / "build.log",
                 "make headers")
            (out / "obj" / "usr" / "include").rename(out / "include")
            shutil.rmtree(out / "obj")
    with building(dest) as out:
        logfile = out / "build.log"
        tree = out / "tree"
        _copy_tree(src, tree)
        _scale_timeouts(tree)
        shutil.copytree(headers / "include", tree / "usr" / "include")
        progress.step("building tools/testing/selftests/vfio with the GPU driver (static)")
        bins = out / "bin"
        _run(["make", "-j2", "-C", str(DRIVER_DIR), f"SELFTESTS={tree / 'tools/testing/selftests'}",
              f"OUTPUT={bins}"], logfile, "make")
        for test in sorted(p.stem for p in bins.glob("*.cases")):
            shutil.copy2(bins / test, out / test)
            shutil.copy2(bins / f"{test}.cases", out / f"{test}.cases")
        for scratch in ("tree", "bin"):
            shutil.rmtree(out / scratch)
        seconds = time.monotonic() - started
        (out / "manifest.json").write_text(json.dumps(
            {"source_version": version, "source": str(src), "build_seconds": round(seconds, 1),
             "tests": sorted(p.stem for p in out.glob("*.cases"))}, indent=2))
    progress.step(f"built {len(read_cases(dest))} tests in {seconds:.0f} s: {dest}")
    return Build(dest, version, read_cases(dest), seconds, cached=False)


# ------------------------------------------------------------------ plan

@dataclass
class Plan:
    """Which cases run in which IOMMU modes: decided before anything boots."""

    modes: tuple[str, ...]
    cases: dict[str, list[Case]]               # test -> selected cases (all modes)
    filters: list[str] = field(default_factory=list)

    @classmethod
    def make(cls, build: Build, backend: str = "all", filters: list[str] | None = None) -> "Plan":
        if backend not in BACKENDS:
            raise LabError(f"unknown backend {backend!r}", f"use one of: {', '.join(BACKENDS)} "
                           f"(type1 = {' + '.join(BACKENDS['type1'])}; iommufd = {' + '.join(BACKENDS['iommufd'])})")
        modes = BACKENDS[backend]
        filters = list(filters or [])
        chosen: dict[str, list[Case]] = {}
        for test, cases in build.cases.items():
            keep = []
            for case in cases:
                if case.mode and case.mode not in modes:
                    continue
                if test == "vfio_iommufd_setup_test" and "iommufd" not in modes:
                    continue
                if filters and not any(_matches(f, test, case) for f in filters):
                    continue
                keep.append(case)
            if keep:
                chosen[test] = keep
        if not chosen:
            what = f"no case matches -k {' -k '.join(filters)}" if filters else "no case to run"
            raise LabError(f"{what} (backend {backend})",
                           "a filter is a substring or glob of TEST.CASE, e.g. driver_test, overflow, "
                           f"'*msi*'; tests: {', '.join(build.tests)}")
        return cls(modes, chosen, filters)

    def count(self) -> int:
        return sum(len(c) for c in self.cases.values())


def _matches(pattern: str, test: str, case: Case) -> bool:
    names = (f"{test}.{case.label}", f"{test}.{case.harness_name}")
    if any(ch in pattern for ch in "*?["):
        return any(fnmatch.fnmatchcase(n, pattern) for n in names)
    return any(pattern in n for n in names)


# ------------------------------------------------------------------ TAP

_RESULT = re.compile(r"^(not ok|ok) \d+ (\S+)(?: # (SKIP|XFAIL|XPASS)\b ?(.*))?$")
_RUN = re.compile(r"^#\s+RUN\s+(\S+) \.\.\.$")


def parse_tap(text: str) -> dict[str, tuple[str, str, str]]:
    """kselftest harness output -> {harness name: (ok|not ok, directive, reason/log)}."""
    out: dict[str, tuple[str, str, str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        if _RUN.match(line):
            current = [line]
            continue
        match = _RESULT.match(line)
        if match:
            status, name, directive, reason = match.groups()
            out[name] = (status, directive or "", (reason or "").strip() or "\n".join(current))
            current = []
        else:
            current.append(line)
    return out


def _kernel_version(release: str) -> tuple[int, int]:
    match = re.match(r"(\d+)\.(\d+)", release)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


def classify(test: str, case: Case, backend: str, tap: tuple[str, str, str] | None, *,
             iommufd: bool, kernel: str, main_output: str = "") -> tuple[str, str]:
    """One case's (result, note)."""
    needs_iommufd = backend in IOMMUFD_MODES and not iommufd
    if tap is None:   # the binary ended before the harness ran the case (its main() failed)
        if needs_iommufd:
            return NEEDS_IOMMUFD, "the guest kernel has no IOMMUFD (/dev/iommu)"
        text = re.sub(r"(?m)^# exit \d+$", "", main_output)
        if re.search(r"(?m)^# exit 4$", main_output):   # KSFT_SKIP from main()
            return SKIP, _last_line(text)
        return FAIL, _last_line(text) or "no result"
    status, directive, detail = tap
    if status == "ok" and directive in ("", "XPASS"):
        return PASS, ""
    if status == "ok" and directive == "SKIP":
        return SKIP, detail.splitlines()[0] if detail else ""
    if needs_iommufd:
        return NEEDS_IOMMUFD, "the guest kernel has no IOMMUFD (/dev/iommu)"
    for known in KNOWN_DIFFERENCES:
        if (known.test, known.case) == (test, case.label) and _kernel_version(kernel) < known.below \
                and re.search(known.evidence, detail):
            return KERNEL_DIFFERENCE, known.why
    if "Device or resource busy" in detail and "open(/dev/vfio" in detail:
        return FAIL, "EBUSY opening the device: an earlier case's process still held it (see the TAP log)"
    if "Test terminated by timeout" in detail:
        return FAIL, f"timed out after {case.timeout * RECIPE['timeout_scale']} s"
    return FAIL, _failure_line(detail)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith(("TAP", "1.."))]
    return lines[-1][:160] if lines else ""


def _failure_line(detail: str) -> str:
    for line in detail.splitlines():
        if re.search(r"Assertion|Expected|FAIL|error|failed", line) and "RUN " not in line:
            return line.strip("# ").strip()[:160]
    return _last_line(detail)


# ------------------------------------------------------------------ run

@dataclass
class Device:
    name: str
    pci_id: str
    bdf: str = ""
    sriov_totalvfs: int = 0

    @property
    def label(self) -> str:
        return f"{self.name} ({self.pci_id})"


def devices_of(topo, vm: str) -> list[Device]:
    """The devices a VM of ``topo`` offers the selftests: its GPUs, then its NICs."""
    return ([Device(g.name, GPU_PCI_ID) for g in topo.gpus_of(vm)]
            + [Device(n.name, n.pci_id) for n in topo.nics_of(vm)])


def _applies(test: str, device: Device) -> bool:
    if test == "vfio_pci_sriov_uapi_test":
        return device.sriov_totalvfs > 0     # it needs an SR-IOV physical function
    return True


def run(lab, vm_name: str, build: Build, plan: Plan, logdir: Path, log=print) -> tuple[list[Result], dict]:
    """Run the plan in a running lab's VM; returns the results and what the guest reported."""
    vm = lab[vm_name]
    devices = devices_of(lab.topology, vm_name)
    if not devices:
        raise LabError(f"VM {vm_name} has no GPU or NIC for the selftests", "boot the 'selftest' topology")
    logdir.mkdir(parents=True, exist_ok=True)
    vm.run(f"rm -rf {GUEST_DIR} && mkdir -p {GUEST_DIR}")
    for test in plan.cases:
        vm.put(str(build.path / test), f"{GUEST_DIR}/{test}")
    vm.run(f"chmod +x {GUEST_DIR}/*")
    guest = json.loads(vm.run("vfio-cxl-m vfio_cxl.guest.cmd.selftest prepare", timeout=300,
                              stdin=json.dumps({"devices": [{"name": d.name, "id": d.pci_id}
                                                            for d in devices]})).stdout)
    for d in devices:
        d.bdf = guest["devices"][d.name]["bdf"]
        d.sriov_totalvfs = guest["devices"][d.name]["sriov_totalvfs"]
    (logdir / "guest.json").write_text(json.dumps(guest, indent=2))
    log(f"[{vm_name}] kernel {guest['kernel']}, IOMMUFD {'yes' if guest['iommufd'] else 'no'}; "
        + ", ".join(f"{d.label} at {d.bdf}" for d in devices))
    # main() of some tests opens the device in the default mode: one the kernel has
    main_mode = "iommufd" if guest["iommufd"] else "vfio_type1v2_iommu"
    results: list[Result] = []
    for test, cases in plan.cases.items():
        for device in devices:
            if not _applies(test, device):
                continue
            per_mode = [c for c in cases if c.mode]
            default = [c for c in cases if not c.mode]
            runs: list[tuple[str, list[tuple[Case, str]]]] = []
            if per_mode:
                runs.append((main_mode, [(c, c.mode) for c in per_mode]))
            if default and test == "vfio_iommufd_setup_test":
                runs.append(("iommufd", [(c, "iommufd") for c in default]))
            elif default:
                for mode in plan.modes:
                    runs.append((mode, [(c, mode) for c in default]))
            for env_mode, chosen in runs:
                results += run_test_binary(vm, test, device, env_mode, chosen, guest, logdir, log)
    return results, guest


def run_test_binary(vm, test: str, device: Device, env_mode: str, chosen: list[tuple[Case, str]],
                guest: dict, logdir: Path, log) -> list[Result]:
    limited = []
    for case, backend in chosen:
        for limit in LAB_LIMITS:
            if (limit.test, limit.mode, limit.device) == (test, backend, device.pci_id):
                if backend in IOMMUFD_MODES and not guest.get("iommufd", True):   # that comes first
                    limited.append(Result(test, case.label, device.label, backend, NEEDS_IOMMUFD,
                                          "the guest kernel has no IOMMUFD (/dev/iommu)"))
                else:
                    limited.append(Result(test, case.label, device.label, backend, LAB_LIMIT, limit.why))
    chosen = [(c, b) for c, b in chosen
              if not any((r.case, r.backend) == (c.label, b) for r in limited)]
    if not chosen:
        return limited
    return limited + _run_cases(vm, test, device, env_mode, chosen, guest, logdir, log)


def _run_cases(vm, test: str, device: Device, env_mode: str, chosen: list[tuple[Case, str]],
               guest: dict, logdir: Path, log) -> list[Result]:
    filters = " ".join(f"-r {shlex.quote(c.harness_name)}" for c, _ in chosen)
    command = (f"cd {GUEST_DIR} && VFIO_SELFTESTS_IOMMU_MODE={env_mode} ./{test} {filters} "
               f"{device.bdf} 2>&1; echo \"# exit $?\"")
    timeout = sum(c.timeout for c, _ in chosen) * RECIPE["timeout_scale"] + 180
    started = time.monotonic()
    out = vm.run(command, timeout=timeout, check=False).stdout
    seconds = time.monotonic() - started
    backends = sorted({b for _, b in chosen}, key=MODES.index)
    name = f"{test}--{device.name}--{'+'.join(backends) if len(backends) < 3 else 'modes'}--{env_mode}.tap.log"
    (logdir / name).write_text(f"$ {command}\n# {seconds:.1f} s\n{out}")
    tap = parse_tap(out)
    results = []
    for case, backend in chosen:
        result, note = classify(test, case, backend, tap.get(case.harness_name), iommufd=guest["iommufd"],
                                kernel=guest["kernel"], main_output=out)
        if result == SKIP and "hugetlb_1gb" in case.harness_name and not guest["hugepages"].get("1G"):
            note += " (the guest could not reserve a 1 GiB huge page at run time)"
        results.append(Result(test, case.label, device.label, backend, result, note))
    counts = {r: sum(1 for x in results if x.result == r) for r in RESULTS}
    log(f"  {test} on {device.name} ({env_mode if len(backends) == 1 else 'per-mode variants'}): "
        + ", ".join(f"{n} {r}" for r, n in counts.items() if n) + f" in {seconds:.0f} s")
    return results


# ------------------------------------------------------------------ report

def summary(results: list[Result]) -> dict:
    return {"passed": sum(r.result == PASS for r in results),
            "failed": sum(r.result == FAIL for r in results),
            "results": [asdict(r) for r in results]}


def table(results: list[Result]) -> str:
    rows = [("test", "case", "device", "backend", "result", "note")]
    rows += [(r.test, r.case, r.device, r.backend, r.result, r.note) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = []
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(widths[j]) for j, cell in enumerate(row[:5])) + "  " + row[5])
        if i == 0:
            lines.append("  ".join("-" * w for w in widths) + "  ----")
    counts = {r: sum(1 for x in results if x.result == r) for r in RESULTS}
    lines.append("")
    lines.append(", ".join(f"{n} {r}" for r, n in counts.items()) + f" ({len(results)} cases)")
    return "\n".join(line.rstrip() for line in lines)
