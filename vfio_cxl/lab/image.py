"""The guest image: a Debian trixie rootfs, kernel 6.12 and a tiny initramfs.

Built from ``images/guest.toml`` (plus ``images/rootfs/`` and
``images/initramfs-init``) into ``<cache>/images/<recipe hash>/``:

* ``vmlinuz``, ``initrd.img`` -- the kernel package's bzImage and the initramfs;
* ``vmlinux``                 -- the ELF kernel inside ``vmlinuz``, unpacked once (also in an
  image built before it was): what -kernel boots, entered at its PVH entry point, so no boot
  stub decompresses it under TCG on every boot (see ``bzimage``);
* ``config``                  -- that kernel's configuration (its CONFIG_HZ sets timer
  figures on the command line);
* ``rootfs.raw``              -- ext4, shared read-only by every VM (each VM
  writes to its own copy-on-write overlay);
* ``id_ed25519[.pub]``        -- the lab's SSH client key, generated at build
  time and authorised for root in the image;
* ``ssh_host_ed25519_key.pub`` -- the guest's host key, so the lab can pin it.

The initramfs holds busybox and the two modules the root disk needs
(virtio_blk, ext4 and their dependencies); systemd is not in the boot path,
which keeps a TCG boot to a few seconds.
"""

from __future__ import annotations

import json
import lzma
import os
import shutil
import subprocess
import tomllib
from dataclasses import dataclass
from pathlib import Path

from ..errors import LabError
from ..paths import cache_root, data_dir
from . import apt, bzimage
from .kconfig import kconfig_hz, parse_config
from .recipe import Progress, building, recipe_hash

IMAGES_DIR = data_dir("images")   # the recipe: images/ of the checkout; a wheel carries a copy
GUEST_HOST_KEY = "/etc/dropbear/dropbear_ed25519_host_key"   # the guest init starts dropbear with it
HOST_PACKAGES = ["mmdebstrap", "cpio", "e2fsprogs", "openssh-client", "kmod", "debian-archive-keyring",
                 "zstd"]   # zstd: Debian's kernel is zstd-compressed (bzimage)


@dataclass(frozen=True)
class GuestImage:
    root: Path

    @property
    def kernel(self) -> Path:
        """What the lab boots: the unpacked ``vmlinux`` (see ``unpack_kernel``), else ``vmlinuz``."""
        vmlinux = self.root / "vmlinux"
        return vmlinux if vmlinux.is_file() else self.root / "vmlinuz"

    @property
    def initrd(self) -> Path:
        return self.root / "initrd.img"

    @property
    def rootfs(self) -> Path:
        return self.root / "rootfs.raw"

    @property
    def ssh_key(self) -> Path:
        return self.root / "id_ed25519"

    @property
    def host_key(self) -> str:
        return (self.root / "ssh_host_ed25519_key.pub").read_text().split()[1]

    @property
    def kernel_hz(self) -> int | None:
        """CONFIG_HZ of the image's kernel (None for an image built without its config)."""
        config = self.root / "config"
        return kconfig_hz(parse_config(config.read_text())) if config.is_file() else None

    @property
    def manifest(self) -> dict:
        return json.loads((self.root / "manifest.json").read_text())


def load_recipe() -> dict:
    with open(IMAGES_DIR / "guest.toml", "rb") as f:
        return tomllib.load(f)


def _recipe_files() -> list[Path]:
    files = [IMAGES_DIR / "guest.toml", IMAGES_DIR / "initramfs-init"]
    files += sorted(p for p in (IMAGES_DIR / "rootfs").rglob("*") if p.is_file())
    return files


def image_path() -> Path:
    return cache_root() / "images" / recipe_hash(*_recipe_files())


def find_image(provision: bool = True, log=print) -> GuestImage:
    dest = image_path()
    if not dest.exists():
        if not provision:
            raise LabError(f"no guest image built for the current recipe ({dest.name})",
                           "run: vfio-cxl provision")
        build_image(dest, log)
    image = GuestImage(dest)
    unpack_kernel(image, log)
    return image


def unpack_kernel(image: GuestImage, log=print) -> None:
    """Unpack the image's kernel into ``vmlinux`` once, when QEMU can enter it (``CONFIG_PVH=y``).
    The bzImage stays the fallback: an image whose directory this user cannot write, or whose
    kernel cannot be unpacked, boots ``vmlinuz`` as before, with one line saying why."""
    out = image.root / "vmlinux"
    config = image.root / "config"
    if out.is_file() or not config.is_file() or parse_config(config.read_text()).get("PVH") != "y":
        return   # QEMU enters an ELF kernel only through its PVH note: without it, the bzImage
    vmlinuz = image.root / "vmlinuz"
    try:
        if bzimage.compression(vmlinuz) == "zstd":
            apt.ensure_host_packages(["zstd"], log)
        bzimage.unpack(vmlinuz, out)
    except (LabError, OSError) as e:
        log(f"booting the compressed kernel {vmlinuz} (decompressed on every boot): cannot unpack it "
            f"to {out}: {e}")


def _run(cmd: list[str], what: str, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, capture_output=True, text=True, env=apt.clean_host_env(), **kwargs)
    if result.returncode != 0:
        tail = "\n".join((result.stdout + result.stderr).splitlines()[-8:])
        raise LabError(f"{what} failed:\n{tail}", "see the output above; fix it and run again")
    return result


def _fetch_kernel(recipe: dict, work: Path, progress: Progress) -> tuple[str, Path]:
    """Download and unpack the kernel package; returns (version, unpacked root)."""
    private = apt.PrivateApt(work / "apt", [recipe["suite"]])
    package = private.resolve(recipe["kernel_package"])
    progress.step(f"downloading {package}")
    (deb,) = private.download([package], work / "debs")
    unpacked = work / "kernel"
    apt.extract_deb(deb, unpacked)
    versions = [p.name for p in (unpacked / "usr/lib/modules").iterdir()]
    if len(versions) != 1:
        raise LabError(f"{package} holds modules for {versions}, expected one kernel", "check the recipe")
    return versions[0], unpacked


def _bootstrap_rootfs(recipe: dict, rootfs: Path, progress: Progress) -> None:
    progress.step(f"mmdebstrap {recipe['suite']} minbase + {len(recipe['packages'])} packages")
    mirror = apt.host_mirror()
    _run(["mmdebstrap", "--variant=minbase", "--quiet",
          "--include=" + ",".join(recipe["packages"]),
          "--dpkgopt=path-exclude=/usr/share/{doc,man,locale,info}/*",
          recipe["suite"], str(rootfs), f"deb {mirror} {recipe['suite']} main"],
         "mmdebstrap of the guest rootfs")


def _install_modules(recipe: dict, version: str, kernel: Path, rootfs: Path) -> None:
    src = kernel / "usr/lib/modules" / version
    dest = rootfs / "usr/lib/modules" / version
    excluded = {src / "kernel" / sub for sub in recipe["kernel_module_excludes"]}
    shutil.copytree(src, dest, ignore=lambda d, names: [n for n in names if Path(d) / n in excluded])
    _run(["depmod", "-b", str(rootfs / "usr"), version], "depmod")


def _module_closure(rootfs: Path, version: str, names: list[str]) -> list[str]:
    """Module files (relative to the modules dir) for ``names``, dependencies first."""
    moddir = rootfs / "usr/lib/modules" / version
    deps: dict[str, list[str]] = {}
    for line in (moddir / "modules.dep").read_text().splitlines():
        path, _, rest = line.partition(":")
        deps[path] = rest.split()
    by_name = {Path(p).name.split(".ko")[0].replace("-", "_"): p for p in deps}
    ordered: list[str] = []

    def visit(path: str) -> None:
        if path in ordered:
            return
        for dep in reversed(deps[path]):
            visit(dep)
        ordered.append(path)

    for name in names:
        if name not in by_name:
            raise LabError(f"module {name} is not a module of kernel {version} (built in?)",
                           "remove it from initramfs_modules in images/guest.toml")
        visit(by_name[name])
    return ordered


def _build_initramfs(recipe: dict, version: str, rootfs: Path, out: Path, work: Path) -> None:
    staging = work / "initramfs"
    for sub in ("bin", "dev", "proc", "sys", "modules", "newroot"):
        (staging / sub).mkdir(parents=True, exist_ok=True)
    shutil.copy2(rootfs / "usr/bin/busybox", staging / "bin/busybox")
    shutil.copy2(IMAGES_DIR / "initramfs-init", staging / "init")
    moddir = rootfs / "usr/lib/modules" / version
    order = []
    for rel in _module_closure(rootfs, version, recipe["initramfs_modules"]):
        name = Path(rel).name.removesuffix(".xz")
        data = (moddir / rel).read_bytes()
        # busybox insmod cannot read compressed modules.
        (staging / "modules" / name).write_bytes(lzma.decompress(data) if rel.endswith(".xz") else data)
        order.append(name)
    (staging / "modules.order").write_text("\n".join(order) + "\n")
    files = sorted(str(p.relative_to(staging)) for p in staging.rglob("*"))
    with open(out, "wb") as f:
        subprocess.run(["cpio", "--quiet", "-o", "-H", "newc", "-R", "0:0"], cwd=staging,
                       input="\n".join(files).encode(), stdout=f, check=True)


def _configure_rootfs(rootfs: Path, out: Path) -> None:
    shutil.copytree(IMAGES_DIR / "rootfs", rootfs, dirs_exist_ok=True, symlinks=True)
    _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "vfio-cxl-lab", "-f", str(out / "id_ed25519")],
         "ssh-keygen")
    ssh_dir = rootfs / "root/.ssh"
    ssh_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    shutil.copy2(out / "id_ed25519.pub", ssh_dir / "authorized_keys")
    os.chmod(ssh_dir / "authorized_keys", 0o600)
    # The host key, made by dropbear's own tool in the rootfs; the lab pins its public half.
    def dropbearkey(*args: str) -> str:
        return _run(["chroot", str(rootfs), "/usr/bin/dropbearkey", *args], "dropbearkey").stdout

    (rootfs / "etc/dropbear").mkdir(exist_ok=True)
    dropbearkey("-t", "ed25519", "-f", GUEST_HOST_KEY)
    shown = dropbearkey("-y", "-f", GUEST_HOST_KEY)
    public = [line for line in shown.splitlines() if line.startswith("ssh-ed25519 ")]
    if len(public) != 1:
        raise LabError(f"dropbearkey -y printed no ssh-ed25519 public key:\n{shown}",
                       "check the dropbear-bin package in images/guest.toml")
    (out / "ssh_host_ed25519_key.pub").write_text(public[0] + "\n")
    (rootfs / "etc/hostname").write_text("vfio-cxl\n")
    (rootfs / "etc/fstab").write_text("/dev/vda / ext4 rw 0 1\n")


def _make_ext4(rootfs: Path, image: Path, slack_mib: int) -> None:
    used = sum(p.lstat().st_size for p in rootfs.rglob("*"))
    size_mib = used // (1 << 20) * 5 // 4 + slack_mib
    with open(image, "wb") as f:
        f.truncate(size_mib << 20)
    _run(["mkfs.ext4", "-q", "-F", "-L", "vfio-cxl-root", "-E", "root_owner=0:0",
          "-d", str(rootfs), str(image)], "mkfs.ext4")


def build_image(dest: Path, log=print) -> GuestImage:
    recipe = load_recipe()
    apt.ensure_host_packages(HOST_PACKAGES, log)
    progress = Progress("image", log)
    progress.step(f"building guest image {dest.name} from images/guest.toml")
    with building(dest) as out:
        work = out / "work"
        version, kernel = _fetch_kernel(recipe, work, progress)
        rootfs = work / "rootfs"
        _bootstrap_rootfs(recipe, rootfs, progress)
        progress.step(f"installing kernel {version} modules")
        _install_modules(recipe, version, kernel, rootfs)
        shutil.copy2(kernel / "boot" / f"vmlinuz-{version}", out / "vmlinuz")
        shutil.copy2(kernel / "boot" / f"config-{version}", out / "config")
        unpack_kernel(GuestImage(out), log)
        progress.step("building initramfs")
        _build_initramfs(recipe, version, rootfs, out / "initrd.img", work)
        _configure_rootfs(rootfs, out)
        progress.step("writing ext4 root filesystem")
        _make_ext4(rootfs, out / "rootfs.raw", recipe["rootfs_slack_mib"])
        (out / "manifest.json").write_text(json.dumps(
            {"kernel": version, "suite": recipe["suite"], "packages": recipe["packages"]}, indent=2))
        shutil.rmtree(work)
    progress.step(f"ready: {dest}")
    return GuestImage(dest)
