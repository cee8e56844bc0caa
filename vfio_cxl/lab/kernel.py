"""Guest kernels: the image's Debian kernel, the lab kernel, or the user's own.

The **lab kernel** is built from Debian's packaged kernel source
(``linux-source-*`` from trixie-backports, fetched through the private apt)
with ``qemu/kernel/lab.config`` merged over ``tinyconfig``: everything the lab's VMs use built in (IOMMUFD, VFIO cdev, CXL,
DAX, virtio, 9p), no modules, and what a Q35 TCG guest never touches left out.
It lands in ``<cache>/kernels/lab-<source version>-<hash of recipe, fragment
and patches>/`` (``vmlinux``, ``bzImage``, ``config``, ``manifest.json``, ``build.log``).

The source is unpacked once per source version (``kernels/src-<version>``, as
Debian ships it: the selftests and headers are built from it).  The lab's
patches (``qemu/kernel/patches/*.patch``, applied in name order) go into a tree
of hard links to it, ``kernels/patched-<version>-<hash of the patches>``, in
which each file a patch changes is a copy of its own.  Objects are kept per
tree built (``kernels/obj-<version>[-<hash>]``), so a changed fragment rebuilds
only what the changed options touch.  Builds run under ``nice -n 19``: they are
long and must not starve running VMs.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import resource
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import LabError
from ..paths import REPO_ROOT, cache_root, data_dir
from . import apt
from .kernel_options import add_kernel_options  # noqa: F401 (the demos import it from here)
from .kconfig import check_config, parse_config, read_kernel_config
from .recipe import Progress, building, recipe_hash

FRAGMENT = data_dir("kernel-config") / "lab.config"   # qemu/kernel/lab.config; a wheel carries a copy
PATCHES = data_dir("kernel-config") / "patches"        # qemu/kernel/patches/*.patch
LAB_RECIPE = {
    "format": 1,
    "suite": "trixie-backports",
    "source_package": "linux-source-7.3",
    "base": ["tinyconfig"],
    "target": "bzImage",
}
# The host's tools for a kernel build (installed with the host's own apt).
BUILD_PACKAGES = ["gcc", "make", "bc", "flex", "bison", "libelf-dev", "libssl-dev", "xz-utils", "lz4",
                  "patch", "debian-archive-keyring"]


@dataclass(frozen=True)
class GuestKernel:
    """A kernel to boot: its image, optional modules tree, extra command line."""

    image: Path
    modules: Path | None = None
    append: str = ""
    label: str = "custom"

    @property
    def config(self) -> dict[str, str]:
        return read_kernel_config(self.image)

    @property
    def takes_lab_boot_params(self) -> bool:
        """Whether the kernel knows the boot parameters of the lab kernel's own patches
        (qemu/kernel/patches: ``lapic_timer_period=``, ``initmem_poison=``,
        ``cxl_core.decoder_settle_ms=``); every lab kernel
        is built with them (they are in its recipe)."""
        return self.label == "lab"


def kernels_root() -> Path:
    root = cache_root() / "kernels"
    root.mkdir(parents=True, exist_ok=True)
    return root


def lab_patches() -> list[Path]:
    """The lab's patches to the kernel source, in the order they apply."""
    return sorted(PATCHES.glob("*.patch"))


def _recipe() -> str:
    return recipe_hash(LAB_RECIPE, FRAGMENT, *lab_patches())


def _key(version: str) -> str:
    return f"lab-{version}-{_recipe()}"


def _newest_built(suffix: str = "") -> Path | None:
    """The newest lab kernel in the cache whose directory name ends with ``suffix``."""
    found = [p for p in kernels_root().glob("lab-*") if p.name.endswith(suffix) and (p / "bzImage").is_file()]
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def cached_lab_kernel() -> Path | None:
    """The newest lab kernel built from the current recipe, fragment and patches, if any (no network)."""
    return _newest_built(f"-{_recipe()}")


def _source_version(private: apt.PrivateApt) -> str:
    out = private.show(LAB_RECIPE["source_package"])
    match = re.search(r"^Version: (\S+)", out, re.M)
    if not match:
        raise LabError(f"apt knows no {LAB_RECIPE['source_package']} in {LAB_RECIPE['suite']}",
                       "check the Debian mirror (VFIO_CXL_DEBIAN_MIRROR)")
    return match.group(1)


def superseded_lab_kernel() -> Path | None:
    """A lab kernel built from an earlier recipe, fragment or patches, when none is built from
    today's: the machine had one, so it wants one (``vfio-cxl provision --refresh-lab-kernel``,
    which ./scripts/test runs, builds it again; the lab-kernel tests would skip without it)."""
    return None if cached_lab_kernel() is not None else _newest_built()


def _unpack_source(private: apt.PrivateApt, version: str, progress: Progress) -> Path:
    src = kernels_root() / f"src-{version}"
    if (src / "Makefile").is_file():
        return src
    with building(src) as out:
        progress.step(f"downloading {LAB_RECIPE['source_package']} {version}")
        debs = private.download([LAB_RECIPE["source_package"]], out / "debs")
        apt.extract_deb(debs[0], out / "deb")
        (tarball,) = (out / "deb" / "usr" / "src").glob("linux-source-*.tar.*")
        progress.step(f"unpacking {tarball.name} ({tarball.stat().st_size >> 20} MiB)")
        (out / "tree").mkdir()
        subprocess.run(["nice", "-n", "19", "tar", "-xf", str(tarball), "-C", str(out / "tree")], check=True)
        (top,) = (out / "tree").iterdir()
        for entry in top.iterdir():
            entry.rename(out / entry.name)
        shutil.rmtree(out / "deb")
        shutil.rmtree(out / "debs")
        shutil.rmtree(out / "tree")
    return src


def _patched_files(patch: Path) -> list[str]:
    """The files a unified diff (``-p1``) changes, from its ``+++ b/...`` lines."""
    names = re.findall(r"^\+\+\+ b/(\S+)", patch.read_text(errors="replace"), re.M)
    if not names:
        raise LabError(f"{patch.name} changes no file (no '+++ b/PATH' line)",
                       "write it as a unified diff with a/ and b/ prefixes (git format-patch, diff -u)")
    outside = [n for n in names if n.startswith("/") or ".." in Path(n).parts]
    if outside:
        raise LabError(f"{patch.name} names a file outside the source tree: {', '.join(outside)}",
                       "give every file as a path inside the kernel source (b/arch/x86/...)")
    return names


def _patched_source(src: Path, version: str, patches: list[Path], progress: Progress) -> Path:
    """The tree the lab kernel is built from: ``src`` itself without patches, else a tree of
    hard links to it with ``patches`` applied.  A file a patch changes is copied first, so the
    pristine tree never sees the change."""
    if not patches:
        return src
    tree = kernels_root() / f"patched-{version}-{recipe_hash(*patches)}"
    if (tree / "Makefile").is_file():
        return tree
    with building(tree) as out:
        progress.step(f"applying {len(patches)} patch{'es' if len(patches) > 1 else ''} to a linked copy of the source")
        subprocess.run(["cp", "-al", f"{src}/.", str(out)], check=True)
        for patch in patches:
            for name in _patched_files(patch):
                target = out / name
                if target.is_file():   # its own inode: patch(1) would write through the link
                    copy = target.with_name(target.name + ".unlinked")
                    shutil.copy2(target, copy)
                    copy.replace(target)
            done = subprocess.run(["patch", "-p1", "--forward", "--batch", "--no-backup-if-mismatch",
                                   "-d", str(out), "-i", str(patch)], capture_output=True, text=True)
            if done.returncode != 0:
                raise LabError(f"{patch.name} does not apply to {LAB_RECIPE['source_package']} {version}:\n"
                               f"{(done.stdout + done.stderr).strip()}",
                               f"rebase it onto that source, or remove it from {PATCHES.relative_to(REPO_ROOT)}")
    return tree


def _make(src: Path, obj: Path, args: list[str], log: Path, progress: Progress | None = None) -> None:
    cmd = ["nice", "-n", "19", "make", "-C", str(src), f"O={obj}", *args]
    with open(log, "a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=apt.clean_host_env())
        compiled = 0
        last = time.monotonic()
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            if line.lstrip().startswith("CC "):
                compiled += 1
            if progress and time.monotonic() - last >= 30:
                progress.step(f"  {compiled} files compiled")
                last = time.monotonic()
        if proc.wait() != 0:
            out.flush()
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-12:])
            raise LabError(f"kernel build step 'make {' '.join(args)}' failed:\n{tail}",
                           f"the whole log is {log}")


def build_lab_kernel(log=print) -> Path:
    """Build (or find) the lab kernel for the current source version and fragment."""
    apt.ensure_host_packages(BUILD_PACKAGES, log)
    progress = Progress("kernel", log)
    private = apt.PrivateApt(kernels_root() / "apt", [LAB_RECIPE["suite"]])
    version = _source_version(private)
    dest = kernels_root() / _key(version)
    if (dest / "bzImage").is_file():
        return dest
    with open(kernels_root() / f".lock-{version}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # one build per source version at a time
        if (dest / "bzImage").is_file():
            return dest
        patches = lab_patches()
        src = _patched_source(_unpack_source(private, version, progress), version, patches, progress)
        obj = kernels_root() / ("obj-" + src.name.split("-", 1)[1])   # src-V -> obj-V, patched-V-H -> obj-V-H
        obj.mkdir(exist_ok=True)
        with building(dest) as out:
            logfile = out / "build.log"
            started = time.monotonic()
            cpu_before = _children_cpu()
            progress.step(f"configuring: {' + '.join(LAB_RECIPE['base'])} + {FRAGMENT.relative_to(REPO_ROOT)}")
            _make(src, obj, LAB_RECIPE["base"], logfile)
            subprocess.run([str(src / "scripts/kconfig/merge_config.sh"), "-m", "-O", str(obj),
                            str(obj / ".config"), str(FRAGMENT)],
                           cwd=src, check=True, capture_output=True, env=apt.clean_host_env())
            _make(src, obj, ["olddefconfig"], logfile)
            _check_fragment(obj / ".config")
            jobs = os.cpu_count() or 1
            progress.step(f"make -j{jobs} {LAB_RECIPE['target']} (niced; log: {dest}/build.log)")
            _make(src, obj, [f"-j{jobs}", LAB_RECIPE["target"]], logfile, progress)
            seconds = time.monotonic() - started
            cpu = _children_cpu() - cpu_before
            shutil.copy2(obj / "arch/x86/boot/bzImage", out / "bzImage")
            shutil.copy2(obj / "vmlinux", out / "vmlinux")   # what the lab boots (PVH: no decompression)
            shutil.copy2(obj / ".config", out / "config")
            release = (obj / "include/config/kernel.release").read_text().strip()
            (out / "manifest.json").write_text(json.dumps(
                {"release": release, "source_package": LAB_RECIPE["source_package"],
                 "source_version": version, "fragment": str(FRAGMENT.relative_to(REPO_ROOT)),
                 "patches": [p.name for p in patches],
                 "build_seconds": round(seconds), "cpu_seconds": round(cpu), "jobs": jobs}, indent=2))
            # CPU time does not depend on what else the machine runs: it gives the idle figure.
            progress.step(f"built {release} in {seconds:.0f} s ({cpu:.0f} CPU-seconds: about "
                          f"{cpu / jobs:.0f} s on {jobs} idle cores)")
    return dest


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _check_fragment(config_path: Path) -> None:
    """Every option the fragment sets must survive olddefconfig (a dependency may veto it)."""
    wanted = parse_config(FRAGMENT.read_text())
    got = parse_config(config_path.read_text())
    lost = [f"{name}={value} (got {got.get(name, 'unset')})" for name, value in wanted.items()
            if value in ("y", "m") and got.get(name) != value]
    if lost:
        raise LabError("the lab kernel's fragment did not take: " + ", ".join(lost),
                       f"add the missing dependencies to {FRAGMENT.relative_to(REPO_ROOT)}")
    check_config(got, "the lab kernel", lab_kernel=True)


def lab_source(provision: bool = True, log=print) -> tuple[str, Path]:
    """The lab kernel's source tree as (source version, path): the one the cached lab kernel
    was built from, else the newest one unpacked, else (``provision``) downloaded and
    unpacked now (``linux-source-*`` through the private apt)."""
    found = cached_lab_kernel()
    if found is not None:
        version = json.loads((found / "manifest.json").read_text())["source_version"]
        if (kernels_root() / f"src-{version}" / "Makefile").is_file():
            return version, kernels_root() / f"src-{version}"
    trees = [p for p in kernels_root().glob("src-*") if (p / "Makefile").is_file()]
    if trees:
        newest = max(trees, key=lambda p: p.stat().st_mtime)
        return newest.name[len("src-"):], newest
    if not provision:
        raise LabError(f"the lab kernel's source ({LAB_RECIPE['source_package']}) is not unpacked",
                       "run: vfio-cxl provision --kernel lab")
    apt.ensure_host_packages(BUILD_PACKAGES, log)
    private = apt.PrivateApt(kernels_root() / "apt", [LAB_RECIPE["suite"]])
    version = _source_version(private)
    with open(kernels_root() / f".lock-{version}", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return version, _unpack_source(private, version, Progress("kernel source", log))


def lab_kernel(provision: bool = True, log=print) -> GuestKernel:
    """The lab kernel: the cached one, else built now (``provision``) or an error."""
    found = cached_lab_kernel()
    if found is None:
        if not provision:
            raise LabError("the lab kernel is not built", "run: vfio-cxl provision --kernel lab")
        found = build_lab_kernel(log)
    return GuestKernel(boot_image(found), label="lab")


def boot_image(built: Path) -> Path:
    """The image of a built lab kernel that the lab boots: ``vmlinux`` (the fragment turns
    on the PVH entry point, so QEMU enters it directly, no boot stub to decompress it under
    TCG); ``bzImage`` for a kernel cached before that."""
    vmlinux = built / "vmlinux"
    return vmlinux if vmlinux.is_file() else built / "bzImage"


def resolve(kernel: str | None, modules: str | None = None, append: str = "",
            provision: bool = True, log=print) -> GuestKernel | None:
    """``--kernel PATH|lab`` (+ ``--modules``, ``--append``) -> a checked GuestKernel, or None
    for the image's own kernel.  Fails before anything is started."""
    if kernel is None:
        if modules:
            raise LabError("--modules needs --kernel", "pass --kernel PATH (the kernel these modules belong to)")
        return GuestKernel(Path(), append=append, label="debian") if append else None
    if kernel == "lab":
        chosen = lab_kernel(provision, log)
    else:
        path = Path(kernel).expanduser()
        if not path.is_file():
            raise LabError(f"--kernel {kernel}: no such file",
                           "give the path of a bzImage (arch/x86/boot/bzImage) or of a vmlinux built "
                           "with CONFIG_PVH=y, or 'lab'")
        chosen = GuestKernel(path.resolve(), label="custom")
    mod_path = None
    if modules:
        mod_path = Path(modules).expanduser().resolve()
        if not mod_path.is_dir() or not (mod_path / "modules.dep").is_file():
            raise LabError(f"--modules {modules}: not a modules tree (no modules.dep)",
                           "give lib/modules/<release> of 'make modules_install INSTALL_MOD_PATH=...'")
    chosen = GuestKernel(chosen.image, mod_path, append, chosen.label)
    config = chosen.config
    check_config(config, str(chosen.image), modules=mod_path is not None)
    if is_elf(chosen.image) and config.get("PVH") != "y":
        # QEMU enters an ELF kernel only through its PVH note, else refuses it at start
        raise LabError(f"--kernel {chosen.image}: an uncompressed vmlinux without CONFIG_PVH=y "
                       "(QEMU boots an ELF kernel only through its PVH entry point)",
                       "give arch/x86/boot/bzImage of that build, or build with CONFIG_PVH=y")
    return chosen


def is_elf(image: Path) -> bool:
    with open(image, "rb") as f:
        return f.read(4) == b"\x7fELF"
