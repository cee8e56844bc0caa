"""The QEMU the lab runs: the system's when it is new enough, else a pinned tree.

The lab needs QEMU >= 10.1 with ``cxl-type3`` (volatile-memdev), ``vfio-user-pci``
and ``intel-iommu``.  Debian 12 ships 7.2, so by default we provision QEMU from
Debian trixie-backports into an mmdebstrap tree under the cache and run it
through bubblewrap: the tree is bound as ``/``, and only the paths a VM needs
(its run directory, the guest image, the checkout it shares) are bound in.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LabError
from ..paths import cache_root
from . import apt
from .recipe import Progress, building, recipe_hash

MIN_VERSION = (10, 1)
REQUIRED_DEVICES = ("cxl-type3", "vfio-user-pci", "intel-iommu")

# Every QEMU package is named with its suite: naming only qemu-system-x86
# lets apt mix in trixie's older qemu-system-common/-data.
TREE_RECIPE = {
    "format": 1,
    "suite": "trixie",
    "extra_suites": ["trixie-backports"],
    "packages": [
        "qemu-system-x86/trixie-backports",
        "qemu-system-common/trixie-backports",
        "qemu-system-data/trixie-backports",
        "seabios/trixie-backports",
    ],
}
HOST_PACKAGES = ["mmdebstrap", "bubblewrap", "debian-archive-keyring"]
USE_SYSTEM_ENV = "VFIO_CXL_SYSTEM_QEMU"  # "0": never use the system QEMU
QEMU_ENV = "VFIO_CXL_QEMU"   # a user's own qemu-system-x86_64 (what `--qemu PATH` sets), checked as any
_NOT_FROM_TREE = {"dev", "proc", "sys", "tmp", "run", "root", "home", "mnt", "media"}


def parse_version(text: str) -> tuple[int, int, int]:
    match = re.search(r"version (\d+)\.(\d+)\.(\d+)", text)
    if not match:
        raise LabError(f"cannot read a QEMU version from {text!r}", "check the QEMU binary")
    return tuple(int(x) for x in match.groups())  # type: ignore[return-value]


@dataclass
class QemuRuntime:
    """How to run qemu-system-x86_64: directly, or inside a bwrap'd tree."""

    tree: Path | None  # None: the system QEMU, or the user's (binary is then its path)
    version: tuple[int, int, int] = (0, 0, 0)
    binary: str = "qemu-system-x86_64"
    _version_text: str = field(default="", repr=False)
    user: bool = False   # the user's own build (--qemu PATH)

    @property
    def version_string(self) -> str:
        where = f"tree {self.tree}" if self.tree else (self.binary if self.user else "system")
        return f"QEMU {'.'.join(map(str, self.version))} ({where})"

    def command(self, argv: list[str], *, rw: list[Path] = (), ro: list[Path] = (),
                chdir: Path | None = None, env: dict[str, str] | None = None) -> list[str]:
        """The full command that runs ``qemu-system-x86_64 argv``.

        ``rw``/``ro`` are host paths the QEMU process needs; inside the tree
        they appear at the same paths.  ``--die-with-parent`` ties QEMU's life
        to ours, so a crashed lab cannot leave a VM running.
        """
        if self.tree is None:
            return [self.binary, *argv]
        # The root stays bwrap's own tmpfs and the tree's top-level directories
        # are bound into it, so the extra paths below can get mount points.
        cmd = ["bwrap"]
        for entry in sorted(self.tree.iterdir()):
            if entry.name in _NOT_FROM_TREE:
                continue
            if entry.is_symlink():
                cmd += ["--symlink", os.readlink(entry), f"/{entry.name}"]
            elif entry.is_dir():
                cmd += ["--ro-bind", str(entry), f"/{entry.name}"]
        cmd += ["--dev-bind", "/dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", "--tmpfs", "/run"]
        for path in ro:
            cmd += ["--ro-bind", str(path), str(path)]
        for path in rw:
            cmd += ["--bind", str(path), str(path)]
        for key, value in (env or {}).items():
            cmd += ["--setenv", key, value]
        if chdir:
            cmd += ["--chdir", str(chdir)]
        cmd += ["--unshare-pid", "--die-with-parent", "--", f"/usr/bin/{self.binary}", *argv]
        return cmd

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(argv, **kwargs), capture_output=True, text=True, timeout=60)

    def devices(self) -> str:
        return self.run(["-device", "help"]).stdout

    def check_features(self) -> None:
        if self.version[:2] < MIN_VERSION:
            raise LabError(f"{self.version_string} is too old (need >= {MIN_VERSION[0]}.{MIN_VERSION[1]})",
                           f"build QEMU >= {MIN_VERSION[0]}.{MIN_VERSION[1]}, or drop --qemu ({QEMU_ENV}) to use "
                           "the lab's" if self.user else
                           f"unset {USE_SYSTEM_ENV} or remove the cached tree to provision a newer one")
        listing = self.devices()
        missing = [d for d in REQUIRED_DEVICES if f'"{d}"' not in listing]
        if missing:
            raise LabError(f"{self.version_string} lacks devices: {', '.join(missing)}",
                           "configure the build with --target-list=x86_64-softmmu and vfio-user "
                           "(--enable-vfio-user-client on QEMU 10.1+), or drop --qemu to use the lab's"
                           if self.user else "provision the pinned QEMU: vfio-cxl provision")


def user_runtime(path: str) -> QemuRuntime:
    """The user's own QEMU build, after the same checks as the lab's (version, devices)."""
    binary = Path(path).expanduser()
    if not binary.is_file() or not os.access(binary, os.X_OK):
        raise LabError(f"--qemu {path}: no executable file there",
                       "give the path of a qemu-system-x86_64 binary, e.g. ~/qemu/build/qemu-system-x86_64")
    runtime = QemuRuntime(tree=None, binary=str(binary.resolve()), user=True)
    try:
        out = subprocess.run([runtime.binary, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise LabError(f"--qemu {path} does not run: {err}", "give a qemu-system-x86_64 built for this host") from None
    if out.returncode != 0:
        raise LabError(f"--qemu {path} does not run: {(out.stderr or out.stdout).strip()[-300:]}",
                       "give a qemu-system-x86_64 built for this host (its libraries installed)")
    runtime.version = parse_version(out.stdout)
    runtime.check_features()
    return runtime


def _user_qemu() -> QemuRuntime | None:
    path = os.environ.get(QEMU_ENV)
    return user_runtime(path) if path else None


def _system_qemu() -> QemuRuntime | None:
    if os.environ.get(USE_SYSTEM_ENV) == "0" or not shutil.which("qemu-system-x86_64"):
        return None
    runtime = QemuRuntime(tree=None)
    out = subprocess.run(["qemu-system-x86_64", "--version"], capture_output=True, text=True).stdout
    runtime.version = parse_version(out)
    try:
        runtime.check_features()
    except LabError:
        return None
    return runtime


def tree_path() -> Path:
    return cache_root() / "qemu" / recipe_hash(TREE_RECIPE)


def _tree_runtime(tree: Path) -> QemuRuntime:
    runtime = QemuRuntime(tree=tree)
    out = runtime.run(["--version"])
    if out.returncode != 0:
        raise LabError(f"the QEMU tree at {tree} does not run: {out.stderr.strip()}",
                       f"remove {tree} and run: vfio-cxl provision")
    runtime.version = parse_version(out.stdout)
    return runtime


def build_tree(dest: Path, log=print) -> None:
    progress = Progress("qemu", log)
    apt.ensure_host_packages(HOST_PACKAGES, log)
    mirror = apt.host_mirror()
    suites = [TREE_RECIPE["suite"], *TREE_RECIPE["extra_suites"]]
    progress.step(f"mmdebstrap {TREE_RECIPE['suite']} minbase + {', '.join(TREE_RECIPE['packages'])}")
    with building(dest) as scratch:
        tree = scratch / "tree"
        cmd = ["mmdebstrap", "--variant=minbase", "--quiet",
               "--include=" + ",".join(TREE_RECIPE["packages"]),
               "--dpkgopt=path-exclude=/usr/share/{doc,man,locale,info}/*",
               TREE_RECIPE["suite"], str(tree),
               *[f"deb {mirror} {suite} main" for suite in suites]]
        result = subprocess.run(cmd, capture_output=True, text=True, env=apt.clean_host_env())
        if result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).splitlines()[-8:])
            raise LabError(f"building the QEMU tree failed:\n{tail}", "check the network and the Debian mirror")
        runtime = _tree_runtime(tree)
        runtime.check_features()
        progress.step(f"ready: {runtime.version_string}")


def planned_runtime() -> QemuRuntime:
    """The runtime ``find_runtime`` would use, without provisioning or running it."""
    if os.environ.get(QEMU_ENV):
        return QemuRuntime(tree=None, binary=str(Path(os.environ[QEMU_ENV]).expanduser().resolve()), user=True)
    return _system_qemu() or QemuRuntime(tree=tree_path() / "tree")


def provisioned_runtime() -> QemuRuntime | None:
    """The runtime in use if it is already there (nothing installed, nothing built), else None."""
    if os.environ.get(QEMU_ENV):
        try:
            return _user_qemu()
        except LabError:
            return None
    system = _system_qemu()
    if system:
        return system
    tree = tree_path() / "tree"
    if not tree.exists() or not shutil.which("bwrap"):
        return None
    try:
        return _tree_runtime(tree)
    except LabError:
        return None


def find_runtime(provision: bool = True, log=print) -> QemuRuntime:
    """The QEMU to use: the user's (--qemu PATH / VFIO_CXL_QEMU) if given, checked; else the
    system's if good enough; else the pinned tree, provisioned when needed and allowed."""
    user = _user_qemu()
    if user:
        return user
    system = _system_qemu()
    if system:
        return system
    dest = tree_path()
    if not dest.exists():
        if not provision:
            raise LabError("no suitable QEMU (need >= 10.1 with cxl-type3, vfio-user-pci, intel-iommu)",
                           "run: vfio-cxl provision")
        build_tree(dest, log)
    if not shutil.which("bwrap"):
        apt.ensure_host_packages(HOST_PACKAGES, log)
    return _tree_runtime(dest / "tree")
