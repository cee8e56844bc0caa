"""``--lab NAME`` / ``$VFIO_CXL_LAB`` (vfio_cxl/lab/borrow.py): what a command borrowing a running
lab checks before it runs, against a real fabric manager over the FAKE lab (fm_fake_lab.py), and
the commands' own refusals.  The VM tests run the documented commands in borrowed labs."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from fm_harness import FakeFm, env  # noqa: F401  (fixture)
from vfio_cxl.errors import LabError
from vfio_cxl.lab import topology
from vfio_cxl.lab.borrow import LAB_ENV, _unfit, add_lab_option, booted_or_borrowed, borrow
from vfio_cxl.paths import REPO_ROOT


def test_the_lab_option_defaults_to_the_environment(monkeypatch):
    parser = argparse.ArgumentParser()
    monkeypatch.setenv(LAB_ENV, "single-4")
    add_lab_option(parser, "single")
    assert parser.parse_args([]).lab == "single-4"
    assert parser.parse_args(["--lab", "p2p-2"]).lab == "p2p-2"
    monkeypatch.setenv(LAB_ENV, "")
    parser = argparse.ArgumentParser()
    add_lab_option(parser, "single")
    assert parser.parse_args([]).lab is None


def test_no_lab_of_that_name(env):  # noqa: F811
    with pytest.raises(LabError) as err:
        borrow("single-9", "single", command="scripts/bench routes")
    assert err.value.what == f"--lab single-9 (or ${LAB_ENV}): no lab named 'single-9'"
    assert "vfio-cxl vm ls" in err.value.fix


def test_a_lab_of_another_topology_is_refused_before_anything_runs(env):  # noqa: F811
    fm = FakeFm()
    with pytest.raises(LabError) as err:
        borrow(fm.name, "p2p", command="scripts/bench p2p")
    assert err.value.what == f"lab {fm.name} is of topology 'fake'; scripts/bench p2p needs 'p2p'"
    assert err.value.fix == "vfio-cxl vm up p2p --detach, then --lab with its name"
    assert fm.alive()


def test_a_gpu_moved_to_another_host_or_another_kernel_is_named(env):  # noqa: F811
    """The check reads the manager's real status: a GPU moved off the VM the topology puts it in,
    and a lab on another kernel than the command asked for."""
    fm = FakeFm("--fabric", "--auto-release")
    fabric = topology.load("fabric")   # gpu0 on a, gpu1 on b: as the fake lab plugs them
    with fm.client() as client:
        assert _unfit(client.status(), fabric, None) is None
        assert _unfit(client.status(), fabric, "debian") is None
        what, fix = _unfit(client.status(), fabric, "lab")
        assert what == "it runs the debian kernel, not the lab kernel"
        assert fix == "vfio-cxl vm up fabric --detach --kernel lab, then --lab with its name"
        client.assign("gpu0", "b", keep_vram=True)
        what, fix = _unfit(client.status(), fabric, None)
        assert what == "GPU gpu0 is attached to b"
        assert fix == "vfio-cxl fm assign gpu0 a --lab {lab}"
        client.release("gpu0")
        assert _unfit(client.status(), fabric, None)[0] == "GPU gpu0 is free"


def test_a_kernel_path_cannot_go_with_a_borrowed_lab(env):  # noqa: F811
    fm = FakeFm()
    with pytest.raises(LabError) as err:
        borrow(fm.name, "fake", command="vfio-cxl demo tour", kernel="custom")
    assert err.value.what.startswith(f"--kernel PATH boots that kernel, and --lab {fm.name} borrows")


def test_a_dead_vm_is_named():
    single = topology.load("single")
    status = {"vms": {"host0": {"state": "dead"}}, "gpus": {}}
    assert _unfit(status, single, None) == ("VM host0 is dead", "vfio-cxl vm down {lab}, then boot it again")


def test_options_that_boot_cannot_go_with_a_borrowed_lab():
    booted = []
    args = argparse.Namespace(lab="single-1", modules="/lib/modules/x", append=None)
    with pytest.raises(LabError) as err:
        booted_or_borrowed(args, "single", lambda: booted.append(1), command="vfio-cxl demo dma")
    assert err.value.what == "--modules boots a lab with a kernel's modules, and --lab single-1 borrows a running lab"
    assert booted == []
    args = argparse.Namespace(lab=None, modules=None)
    booted_or_borrowed(args, "single", lambda: booted.append(1), command="vfio-cxl demo dma")
    assert booted == [1]


@pytest.mark.parametrize("argv", [
    ["-m", "vfio_cxl.bench", "p2p", "--size", "1M"],
    ["-m", "vfio_cxl.bench", "nic", "--quick"],
    ["-m", "vfio_cxl", "demo", "dma"],
    ["-m", "vfio_cxl", "selftest", "vfio", "-k", "nothing-matches-this"],   # before its filter, its build
])
def test_commands_refuse_a_lab_that_is_not_running_in_one_line(env, argv):  # noqa: F811
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=REPO_ROOT, timeout=120,
                          env={**__import__("os").environ, LAB_ENV: "gone-3"})
    assert done.returncode == 1, done
    assert "no lab named 'gone-3'" in done.stderr and "Traceback" not in done.stderr, done.stderr
