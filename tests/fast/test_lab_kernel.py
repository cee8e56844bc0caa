"""Bring your own kernel: reading a kernel's config and refusing one the lab cannot use.

The kernel configs and "kernel images" here are synthetic, made by the tests:
what is under test is our own reading and checking of them (the config file
beside an image, the IKCONFIG blob inside one, the list of what the lab
needs).  The real lab kernel, when it is built, is checked at the end.
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
import zlib

import pytest

from vfio_cxl.errors import LabError
from vfio_cxl.lab import kconfig, kernel
from vfio_cxl.lab.argv import MODULES_MOUNT_TAG
from vfio_cxl.paths import REPO_ROOT


def good_config() -> dict[str, str]:
    """Every option the lab needs, built in."""
    config = {option: "y" for need in kconfig.NEEDS for option in need.options}
    config["DEV_DAX_KMEM"] = "n"
    return config


def config_text(config: dict[str, str]) -> str:
    return "".join(f"CONFIG_{k}={v}\n" if v != "n" else f"# CONFIG_{k} is not set\n" for k, v in config.items())


def fake_bzimage(tmp_path, config: dict[str, str], *, embedded: bool, beside: bool = False):
    """A file standing in for a bzImage: junk, then (optionally) a gzip stream whose
    content holds IKCFG_ST + gzip(config) + IKCFG_ED, as a real compressed vmlinux does."""
    image = tmp_path / "bzImage"
    payload = b"\x7fELF" + os.urandom(4096)
    if embedded:
        payload += kconfig.IKCFG_START + gzip.compress(config_text(config).encode()) + kconfig.IKCFG_END
    payload += os.urandom(1024)
    image.write_bytes(b"MZ" + os.urandom(512) + zlib.compress(b"decoy")
                      + gzip.compress(payload) + os.urandom(256))
    if beside:
        (tmp_path / ".config").write_text(config_text(config))
    return image


def test_parse_config_reads_values_and_not_set_lines():
    parsed = kconfig.parse_config('CONFIG_A=y\nCONFIG_B=m\n# CONFIG_C is not set\nCONFIG_D="x y"\n# comment\n')
    assert parsed == {"A": "y", "B": "m", "C": "n", "D": "x y"}


def test_config_found_inside_a_compressed_image(tmp_path):
    config = good_config()
    image = fake_bzimage(tmp_path, config, embedded=True)
    assert kernel.GuestKernel(image).config == {k: v for k, v in config.items()}


def test_config_beside_the_image_wins(tmp_path):
    config = good_config()
    config["CXL_REGION"] = "n"
    image = fake_bzimage(tmp_path, good_config(), embedded=True, beside=False)
    (tmp_path / ".config").write_text(config_text(config))
    assert kconfig.read_kernel_config(image)["CXL_REGION"] == "n"


def test_a_kernel_without_any_config_is_refused_with_a_way_out(tmp_path):
    image = fake_bzimage(tmp_path, {}, embedded=False)
    with pytest.raises(LabError) as err:
        kernel.resolve(str(image))
    assert "cannot find the config" in err.value.what and "IKCONFIG" in err.value.fix


def test_missing_cxl_region_is_named_with_the_feature_needing_it(tmp_path):
    config = good_config()
    config["CXL_REGION"] = "n"
    image = fake_bzimage(tmp_path, config, embedded=True)
    with pytest.raises(LabError) as err:
        kernel.resolve(str(image))
    lines = err.value.what.splitlines()[1:]
    assert len(lines) == 1
    assert "CONFIG_CXL_REGION=y" in lines[0] and "region creation" in lines[0]


def test_every_missing_option_is_listed(tmp_path):
    config = good_config()
    for option in ("VFIO_PCI", "INTEL_IOMMU", "DEV_DAX_CXL", "9P_FS"):
        del config[option]
    config["DEV_DAX_KMEM"] = "y"
    problems = kconfig.problems(config)
    assert len(problems) == 5
    text = "\n".join(problems)
    for option in ("VFIO_PCI", "INTEL_IOMMU", "DEV_DAX_CXL", "9P_FS", "DEV_DAX_KMEM"):
        assert f"CONFIG_{option}" in text
    assert "devdax" in text and "vIOMMU" in text and "/opt/vfio-cxl" in text


def test_modules_count_only_with_a_modules_tree_and_never_for_the_boot_path():
    config = good_config()
    config["CXL_PCI"] = "m"
    config["VIRTIO_BLK"] = "m"
    without = kconfig.problems(config)
    assert any("CXL_PCI" in p and "no --modules tree" in p for p in without)
    with_modules = kconfig.problems(config, modules=True)
    assert len(with_modules) == 1 and "VIRTIO_BLK" in with_modules[0] and "built-in needed" in with_modules[0]


def test_the_lab_kernel_must_also_have_iommufd():
    config = good_config()
    assert kconfig.problems(config, lab_kernel=True) == []
    del config["IOMMUFD"]
    assert ["IOMMUFD" in p for p in kconfig.problems(config, lab_kernel=True)] == [True]


def test_modules_dir_must_be_a_modules_tree(tmp_path):
    image = fake_bzimage(tmp_path, good_config(), embedded=True)
    with pytest.raises(LabError, match="not a modules tree"):
        kernel.resolve(str(image), modules=str(tmp_path))
    with pytest.raises(LabError, match="--modules needs --kernel"):
        kernel.resolve(None, modules=str(tmp_path))


def vfio_cxl(*args):
    return subprocess.run([sys.executable, "-m", "vfio_cxl", *args], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=60)


def test_cli_no_such_kernel_is_one_line_and_leaves_nothing(tmp_path):
    rundir = tmp_path / "run"
    rundir.mkdir()
    env = {**os.environ, "VFIO_CXL_RUNDIR": str(rundir)}
    result = subprocess.run([sys.executable, "-m", "vfio_cxl", "vm", "up", "single", "--kernel", "/no/such/file"],
                            capture_output=True, text=True, cwd=REPO_ROOT, timeout=60, env=env)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "vfio-cxl: error: --kernel /no/such/file: no such file -- give the path of a bzImage "
        "(arch/x86/boot/bzImage) or of a vmlinux built with CONFIG_PVH=y, or 'lab'"]
    assert list(rundir.iterdir()) == []


def test_cli_refuses_a_kernel_without_cxl_region_before_booting(tmp_path):
    config = good_config()
    config["CXL_REGION"] = "n"
    image = fake_bzimage(tmp_path, config, embedded=True)
    result = vfio_cxl("vm", "up", "single", "--kernel", str(image), "--dry-run")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "CONFIG_CXL_REGION=y" in result.stderr


def test_dry_run_shows_the_kernel_modules_share_and_append(tmp_path):
    image = fake_bzimage(tmp_path, good_config(), embedded=True)
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "modules.dep").write_text("")
    result = vfio_cxl("vm", "up", "single", "--kernel", str(image), "--modules", str(modules),
                      "--append", "dyndbg=+p", "--dry-run")
    assert result.returncode == 0, result.stderr
    line = next(l for l in result.stdout.splitlines() if l.startswith("qemu-system"))
    assert f"-kernel {image}" in line
    assert f"mount_tag={MODULES_MOUNT_TAG}" in line and f"path={modules}" in line
    assert "vfio_cxl.modules=1 " in line and "dyndbg=+p' -name" in line   # --append comes last
    # A kernel not the image's mounts the root disk itself: no initramfs.
    assert "-initrd" not in line and "root=/dev/vda rootfstype=ext4 rootwait rw init=/sbin/vfio-cxl-init" in line


def test_the_image_kernel_keeps_its_initramfs():
    result = vfio_cxl("vm", "up", "single", "--append", "dyndbg=+p", "--dry-run")
    assert result.returncode == 0, result.stderr
    line = next(l for l in result.stdout.splitlines() if l.startswith("qemu-system"))
    assert "-initrd " in line and "root=" not in line and "vfio_cxl.name=host0 " in line
    assert "dyndbg=+p' -name" in line   # --append comes last


def test_the_built_lab_kernel_carries_its_config_and_passes_the_check():
    found = kernel.cached_lab_kernel()
    if found is None:
        pytest.skip("the lab kernel is not built (vfio-cxl provision --kernel lab)")
    embedded = kconfig.extract_ikconfig((found / "bzImage").read_bytes())
    assert embedded is not None, "IKCONFIG missing from the lab kernel"
    config = kconfig.parse_config(embedded)
    assert config == kconfig.parse_config((found / "config").read_text())
    assert kconfig.problems(config, lab_kernel=True) == []


def test_the_lab_boots_the_built_vmlinux_through_its_pvh_entry():
    found = kernel.cached_lab_kernel()
    if found is None:
        pytest.skip("the lab kernel is not built (vfio-cxl provision --kernel lab)")
    chosen = kernel.resolve("lab", provision=False)
    assert chosen.image == found / "vmlinux" and kernel.is_elf(chosen.image)
    assert chosen.config["PVH"] == "y"


def test_a_vmlinux_without_pvh_is_refused_naming_the_option_and_the_bzimage(tmp_path):
    image = tmp_path / "vmlinux"
    image.write_bytes(b"\x7fELF" + os.urandom(4096))      # an ELF kernel, as far as the lab reads it
    config = good_config()
    (tmp_path / ".config").write_text(config_text(config))
    with pytest.raises(LabError) as err:
        kernel.resolve(str(image))
    assert "CONFIG_PVH=y" in err.value.what and "bzImage" in err.value.fix
    config["PVH"] = "y"
    (tmp_path / ".config").write_text(config_text(config))
    assert kernel.resolve(str(image)).image == image


def test_a_real_kernel_without_cxl_region_is_refused_before_anything_starts(tmp_path):
    """The lab kernel's own bzImage, with a config beside it that lacks CONFIG_CXL_REGION
    (a kernel "made by config": the config beside an image is what the lab reads first).
    ``vm up`` (not a dry run) must refuse it before creating a run directory or a QEMU."""
    found = kernel.cached_lab_kernel()
    if found is None:
        pytest.skip("the lab kernel is not built (vfio-cxl provision --kernel lab)")
    image = tmp_path / "kernel" / "bzImage"
    image.parent.mkdir()
    shutil.copyfile(found / "bzImage", image)
    config = (found / "config").read_text().replace("CONFIG_CXL_REGION=y", "# CONFIG_CXL_REGION is not set")
    (image.parent / ".config").write_text(config)
    rundir = tmp_path / "run"
    rundir.mkdir()
    result = subprocess.run([sys.executable, "-m", "vfio_cxl", "vm", "up", "single", "--kernel", str(image)],
                            capture_output=True, text=True, cwd=REPO_ROOT, timeout=60,
                            env={**os.environ, "VFIO_CXL_RUNDIR": str(rundir)})
    assert result.returncode == 1 and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert lines[0] == f"vfio-cxl: error: kernel {image} lacks what the lab needs:"
    assert len(lines) == 2 and "CONFIG_CXL_REGION=y: needed for CXL enumeration and region creation" in lines[1]
    assert list(rundir.iterdir()) == []


@pytest.mark.parametrize("demo", ["tour", "dma", "share", "p2p"])
def test_every_demo_takes_kernel_and_refuses_a_missing_one_before_booting(tmp_path, demo):
    rundir = tmp_path / "run"
    rundir.mkdir()
    result = subprocess.run([sys.executable, "-m", "vfio_cxl", "demo", demo, "--kernel", "/no/such/file"],
                            capture_output=True, text=True, cwd=REPO_ROOT, timeout=60,
                            env={**os.environ, "VFIO_CXL_RUNDIR": str(rundir)})
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "--kernel /no/such/file: no such file" in result.stderr
    assert list(rundir.iterdir()) == []


def test_guest_gpu_dma_takes_sizes_with_units():
    from vfio_cxl.guest.cmd.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["gpu", "dma", "--size", "16M"]).size == 16 << 20
    assert parse(["gpu", "dma", "--size", "512KiB"]).size == 512 << 10
    assert parse(["gpu", "dma", "--size", "0x100000"]).size == 1 << 20
    with pytest.raises(SystemExit):
        parse(["gpu", "dma", "--size", "lots"])


def test_markers_outside_any_stream_do_not_hide_the_real_config(tmp_path):
    """An LZ4-compressed image carries IKCFG_ST..IKCFG_ED as literals with LZ4 tokens between:
    not a gzip stream.  The search goes on into the compressed streams (synthetic image)."""
    config = good_config()
    blob = gzip.compress(config_text(config).encode())
    literal_copy = kconfig.IKCFG_START + blob[:40] + b"\xf0\x13" + blob[40:] + kconfig.IKCFG_END
    real = gzip.compress(b"\x7fELF" + kconfig.IKCFG_START + blob + kconfig.IKCFG_END)
    image = tmp_path / "bzImage"
    image.write_bytes(b"MZ" + os.urandom(256) + literal_copy + os.urandom(64) + real)
    assert kconfig.read_kernel_config(image) == config


# The lab's patches to the kernel source (qemu/kernel/patches): applied by patch(1) in a tree
# of hard links, so the unpacked source stays as Debian ships it.

def small_source(tmp_path):
    src = tmp_path / "src"
    (src / "arch/x86").mkdir(parents=True)
    (src / "Makefile").write_text("all:\n")
    (src / "arch/x86/apic.c").write_text("int a;\nint b;\n")
    return src


def patch_file(tmp_path, name, old, new, path="arch/x86/apic.c"):
    a, b = tmp_path / "pa", tmp_path / "pb"
    for root, text in ((a, old), (b, new)):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    out = subprocess.run(["diff", "-u", "--label", f"a/{path}", "--label", f"b/{path}", str(a / path), str(b / path)],
                         capture_output=True, text=True).stdout
    patch = tmp_path / name
    patch.write_text("Subject: a change\n\n---\n" + out)
    shutil.rmtree(a), shutil.rmtree(b)
    return patch


@pytest.fixture
def kernels_in(tmp_path, monkeypatch):
    root = tmp_path / "kernels"
    root.mkdir()
    monkeypatch.setattr(kernel, "kernels_root", lambda: root)
    return root


def test_patches_go_into_a_linked_copy_and_leave_the_source_as_shipped(tmp_path, kernels_in):
    src = small_source(tmp_path)
    patch = patch_file(tmp_path, "0001-b.patch", "int a;\nint b;\n", "int a;\nint b = 1;\n")
    tree = kernel._patched_source(src, "7.3", [patch], kernel.Progress("t", lambda _: None))
    assert tree.parent == kernels_in and tree.name.startswith("patched-7.3-")
    assert (tree / "arch/x86/apic.c").read_text() == "int a;\nint b = 1;\n"
    assert (src / "arch/x86/apic.c").read_text() == "int a;\nint b;\n"           # pristine
    assert (tree / "Makefile").stat().st_ino == (src / "Makefile").stat().st_ino  # linked, not copied
    assert (tree / "arch/x86/apic.c").stat().st_nlink == (src / "arch/x86/apic.c").stat().st_nlink == 1
    # found again, not patched twice
    assert kernel._patched_source(src, "7.3", [patch], kernel.Progress("t", lambda _: None)) == tree
    assert kernel._patched_source(src, "7.3", [], kernel.Progress("t", lambda _: None)) == src


def test_a_patch_that_does_not_apply_is_named_and_leaves_no_tree(tmp_path, kernels_in):
    src = small_source(tmp_path)
    patch = patch_file(tmp_path, "0002-stale.patch", "int x;\nint y;\n", "int x;\nint y = 2;\n")
    with pytest.raises(LabError, match="0002-stale.patch does not apply to linux-source-7.3 7.3") as err:
        kernel._patched_source(src, "7.3", [patch], kernel.Progress("t", lambda _: None))
    assert "qemu/kernel/patches" in err.value.fix
    assert [p.name for p in kernels_in.iterdir()] == []                       # no half-patched tree
    assert (src / "arch/x86/apic.c").read_text() == "int a;\nint b;\n"


@pytest.mark.parametrize("name, text, message", [
    ("0003-empty.patch", "Subject: nothing\n\njust words\n", "0003-empty.patch changes no file"),
    ("0004-escape.patch", "--- a/../../etc/passwd\n+++ b/../../etc/passwd\n@@ -1 +1 @@\n-x\n+y\n",
     "0004-escape.patch names a file outside the source tree: ../../etc/passwd"),
])
def test_a_patch_without_a_file_in_the_tree_is_refused_before_anything_is_touched(tmp_path, kernels_in,
                                                                                  name, text, message):
    bad = tmp_path / name
    bad.write_text(text)
    with pytest.raises(LabError, match=message):
        kernel._patched_source(small_source(tmp_path), "7.3", [bad], kernel.Progress("t", lambda _: None))
    assert [p.name for p in kernels_in.iterdir()] == []


def test_the_patches_are_part_of_the_lab_kernels_recipe(tmp_path, monkeypatch):
    before = kernel._recipe()
    extra = tmp_path / "patches"
    extra.mkdir()
    for p in kernel.lab_patches():
        shutil.copy(p, extra / p.name)
    monkeypatch.setattr(kernel, "PATCHES", extra)
    assert kernel._recipe() == before                   # same patches, same kernel
    (extra / "0099-more.patch").write_text("+++ b/x\n")
    assert kernel._recipe() != before                   # another patch, another kernel


def test_the_lab_patches_apply_to_the_unpacked_source():
    """The real patches against the real source, when it is unpacked."""
    kernels = kernel.cache_root() / "kernels"
    trees = sorted(t for t in kernels.glob("src-*") if (t / "Makefile").is_file()) if kernels.is_dir() else []
    if not trees:
        pytest.skip("the lab kernel's source is not unpacked (vfio-cxl provision --kernel lab)")
    assert kernel.lab_patches(), "qemu/kernel/patches holds the lab kernel's patches"
    for patch in kernel.lab_patches():
        assert all((trees[-1] / name).is_file() for name in kernel._patched_files(patch))
        done = subprocess.run(["patch", "-p1", "--dry-run", "--forward", "--batch", "-d", str(trees[-1]),
                               "-i", str(patch)], capture_output=True, text=True)
        assert done.returncode == 0, (patch.name, done.stdout + done.stderr)


def test_a_lab_kernel_of_an_earlier_recipe_is_named_for_rebuilding(tmp_path, kernels_in):
    """Plain `vfio-cxl provision` rebuilds the lab kernel on a machine that had one of an
    earlier recipe (new patches, a changed fragment), else its tests would quietly skip."""
    assert kernel.superseded_lab_kernel() is None                       # never built: nothing to do
    old = kernels_in / "lab-7.3-0000000000000000"
    old.mkdir()
    (old / "bzImage").write_bytes(b"k")
    assert kernel.superseded_lab_kernel() == old
    (kernels_in / "lab-7.3-1111111111111111").mkdir()                  # a failed build: no image
    assert kernel.superseded_lab_kernel() == old
    current = kernels_in / f"lab-7.3-{kernel._recipe()}"
    current.mkdir()
    (current / "bzImage").write_bytes(b"k")
    assert kernel.superseded_lab_kernel() is None                       # today's is there


def test_only_the_test_command_refreshes_a_superseded_lab_kernel(monkeypatch, capsys):
    """`vfio-cxl provision --refresh-lab-kernel` (./scripts/test) builds a lab kernel of an earlier
    recipe again; plain `vfio-cxl provision` (the demos) never builds one."""
    from vfio_cxl import cli
    built = []
    monkeypatch.setattr(kernel, "superseded_lab_kernel", lambda: kernel.Path("/cache/kernels/lab-7.3-0000"))
    monkeypatch.setattr(kernel, "lab_kernel", lambda: built.append(1) or kernel.GuestKernel(kernel.Path("vmlinux")))
    monkeypatch.setattr("vfio_cxl.lab.qemu_runtime.find_runtime", lambda: type("R", (), {"version_string": "QEMU"})())
    monkeypatch.setattr("vfio_cxl.lab.image.find_image",
                        lambda: type("I", (), {"root": "img", "manifest": {"kernel": "6.12"}})())
    parser = cli.build_parser()
    parser.parse_args(["provision"]).func(parser.parse_args(["provision"]))
    assert built == []
    args = parser.parse_args(["provision", "--refresh-lab-kernel"])
    args.func(args)
    assert built == [1]
    assert "the lab kernel's recipe changed since lab-7.3-0000 was built: building it again" in capsys.readouterr().out
    assert "--refresh-lab-kernel" in (kernel.REPO_ROOT / "scripts/test").read_text()
