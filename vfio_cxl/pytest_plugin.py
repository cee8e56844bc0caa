"""pytest plugin: a vfio-cxl lab for your own tests (registered under ``pytest11``).

    import pytest

    @pytest.mark.lab("single")                  # a topology name or a topology file
    def test_my_module(lab):
        assert "6.12" in lab.ssh("host0", "uname -r")
        lab.fm.status()                          # the lab's fabric manager (FmClient)

The ``lab`` fixture boots the marker's topology as a detached lab (``vfio-cxl vm up
TOPOLOGY --detach``: a fabric manager owns it) on the marker's ``kernel=`` or
``--lab-kernel PATH`` (default: the guest image's kernel), or reuses the one an earlier test
of the session booted with the same topology and kernel, if it is still healthy and that test
passed.  One lab runs at a time (a TCG VM is CPU-bound): a test of another topology brings
the previous lab down first.  ``--lab-keep``: the lab of a failing test stays up and the run
ends by saying how to reach it (``vfio-cxl vm ssh``) and bring it down (``vfio-cxl vm down``).
See docs/pytest-plugin.md.

Tests are grouped by lab (stable otherwise) so each lab boots once per session.  The same
session pool (``lab_pool``) also runs in-process labs (``lab_pool.get(TOPOLOGY)``, a
``vfio_cxl.lab.lab.Lab``), which this project's own VM tests use for direct access to QEMU.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

MARKER = "lab"
KEPT = pytest.StashKey[list]()       # labs left up by --lab-keep: (test id, how to reach it)
KEPT_OUTPUT = "vfio_cxl_kept"        # the same, from a pytest-xdist worker to its controller
REPORTS = pytest.StashKey[dict]()    # item -> {phase: report}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("vfio-cxl", "vfio-cxl labs (the `lab` fixture)")
    group.addoption("--lab-kernel", metavar="PATH", default=None,
                    help="boot labs of @pytest.mark.lab tests on this kernel (a bzImage, or 'lab' for "
                         "the lab kernel) unless the marker names one; default: the guest image's kernel")
    group.addoption("--lab-keep", action="store_true", default=False,
                    help="leave the lab of a failing test up and print how to reach it")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "lab(topology, kernel=None): the test gets a booted vfio-cxl lab of TOPOLOGY "
                   "(a name or a .toml file) as the `lab` fixture; kernel: a bzImage path or 'lab'")
    config.stash[KEPT] = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    item.stash.setdefault(REPORTS, {})[report.when] = report
    return report


def lab_key(item) -> tuple[str, str | None] | None:
    """(topology, kernel) of an item's ``lab`` marker, or None."""
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return None
    return marker_key(marker, item.config.getoption("--lab-kernel"))


def marker_key(marker, default_kernel: str | None) -> tuple[str, str | None]:
    args, kwargs = list(marker.args), dict(marker.kwargs)
    if not args and "topology" in kwargs:
        args.append(kwargs.pop("topology"))
    kernel = kwargs.pop("kernel", None)
    if len(args) != 1 or not isinstance(args[0], str) or kwargs or not (kernel is None or isinstance(kernel, str)):
        raise pytest.UsageError(f"@pytest.mark.lab{marker.args!r} {marker.kwargs!r}: write "
                                '@pytest.mark.lab("TOPOLOGY") or @pytest.mark.lab("TOPOLOGY", kernel="PATH")')
    return args[0], kernel if kernel is not None else default_kernel


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Tests of one lab run one after the other (stable: file order within a lab), so each lab
    boots once; tests without the marker keep their place before them."""
    first_seen: dict = {}
    for item in items:
        key = lab_key(item)
        if key is not None:
            first_seen.setdefault(key, len(first_seen))
    items.sort(key=lambda item: (0, -1) if (key := lab_key(item)) is None else (1, first_seen[key]))


# -- a lab that stays up, driven through its fabric manager ---------------------------------------

@dataclass
class RunningLab:
    """A detached lab, by name: what the ``lab`` fixture gives a test.

    ``vms`` and ``ports`` (VM name -> SSH port on 127.0.0.1), ``ssh(vm, command)``,
    ``fm`` (the fabric manager's client, connected), ``status()``."""

    name: str
    topology: str
    kernel: str | None = None
    vms: list[str] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)

    def __post_init__(self):
        self._fm = None
        self._shells: dict = {}
        if not self.vms:
            from .lab.fm import registry

            record = registry.find(self.name)
            self.ports = {vm: info["ssh_port"] for vm, info in record.vms.items()}
            self.vms = list(self.ports)

    @classmethod
    def boot(cls, topology: str, kernel: str | None = None, echo=print) -> "RunningLab":
        from .lab.fm.launch import launch

        info = launch(topology, kernel=kernel, echo=echo)
        return cls(info["name"], topology, kernel)

    @property
    def fm(self):
        """The lab's fabric manager (vfio_cxl.lab.fm.client.FmClient), connected."""
        from .lab.fm.client import FmClient

        if self._fm is None or self._fm.poisoned:
            if self._fm is not None:
                self._fm.close()
            self._fm = FmClient.for_lab(self.name, timeout=300).connect()
        return self._fm

    def status(self) -> dict:
        return self.fm.status()

    def shell(self, vm: str):
        """The open SSH connection to ``vm`` (vfio_cxl.lab.ssh.GuestShell), made at first use."""
        from .lab.borrow import guest_shell

        if vm not in self._shells:
            self._shells[vm] = guest_shell(self.fm, self.name, vm)
        return self._shells[vm]

    def ssh(self, vm: str, command: str, *, check: bool = True, timeout: float = 600) -> str:
        """Run a shell command line in ``vm``; its stdout.  A non-zero exit raises
        vfio_cxl.lab.ssh.GuestCommandError (its message ends with the guest's stderr; fields
        ``exited``, ``stdout``, ``stderr``) unless ``check=False``."""
        return self.shell(vm).run(command, timeout=timeout, check=check).stdout

    def alive(self) -> bool:
        from .lab.fm import registry

        return any(r.name == self.name and r.fm_alive() for r in registry.records())

    def healthy(self) -> bool:
        """Up, every VM running, no GPU or controller failed, no GPU mid-move: fit for the next test."""
        if not self.alive():
            return False
        try:
            status = self.fm.status()
        except Exception:   # an FM that does not answer is not fit for anything
            return False
        # Not the lab's own state: it stays "degraded" after a death the test repaired (fm restart).
        return (status["state"] in ("running", "degraded")
                and all(vm["state"] == "running" for vm in status["vms"].values())
                and all(gpu["state"] in ("attached", "free") for gpu in status["gpus"].values())
                and all(smc["state"] != "failed" for smc in status.get("smcs", {}).values()))

    def disconnect(self) -> None:
        for shell in self._shells.values():
            shell.close()
        self._shells.clear()
        if self._fm is not None:
            self._fm.close()
            self._fm = None

    def down(self) -> None:
        """``vfio-cxl vm down`` of this lab (if it is still registered)."""
        from .lab.fm import registry
        from .lab.fm.cleanup import down

        self.disconnect()
        for record in registry.records():
            if record.name == self.name:
                down(record, log=lambda text: None)

    def how_to_reach(self) -> str:
        vm = self.vms[0] if self.vms else "VM"
        return (f"lab {self.name} ({self.topology}) is up: VMs "
                + ", ".join(f"{v} (ssh port {p})" for v, p in self.ports.items())
                + f"\n    vfio-cxl vm ssh --lab {self.name} {vm}        a shell in {vm}"
                + f"\n    vfio-cxl fm status --lab {self.name}"
                + f"\n    vfio-cxl vm down {self.name}              when you are done")


# -- the session's labs: one at a time -----------------------------------------------------------

class LabPool:
    """The session's labs, one running at a time (two cores under TCG).

    ``get(TOPOLOGY, kernel)``: an in-process lab (vfio_cxl.lab.lab.Lab, stopped with the pool).
    ``running(TOPOLOGY, kernel)``: a detached lab (RunningLab) that the pool keeps for the next
    test asking for the same (topology, kernel).  ``kept``: the detached labs kept for reuse,
    by key; each value has ``.name`` and ``.down()``.  Booting either kind first stops the
    other labs the pool holds; ``close()`` stops the in-process lab, ``close_all()`` all."""

    def __init__(self):
        self._runtime = None
        self._image = None
        self.current = None
        self.kept: dict = {}

    @property
    def runtime(self):
        from .lab.qemu_runtime import find_runtime

        self._runtime = self._runtime or find_runtime()
        return self._runtime

    @property
    def image(self):
        from .lab.image import find_image

        self._image = self._image or find_image()
        return self._image

    def get(self, name: str, kernel=None):
        """The in-process lab of topology ``name`` on ``kernel``: the one the pool holds if it is
        still as it booted (``Lab.unhealthy``), else a fresh boot."""
        if self.current and self.current.topology.name == name and self.current.kernel == kernel:
            why = self.current.unhealthy()
            if why is None:
                return self.current
            from .lab import usage   # the session's summary names each lab booted again
            usage.record("reboot", f"{name}: {why}")
        self.close_all()
        from .lab import topology
        from .lab.lab import Lab

        lab = Lab(topology.load(name), runtime=self.runtime, image=self.image, kernel=kernel)
        self.current = lab.start()
        return lab

    def running(self, topology: str, kernel: str | None = None) -> RunningLab:
        key = (topology, kernel)
        kept = self.kept.get(key)
        if kept is not None:
            lab = kept if isinstance(kept, RunningLab) else RunningLab(kept.name, topology, kernel)
            if lab.healthy():
                self.kept[key] = lab
                return lab
        self.close_all()
        lab = RunningLab.boot(topology, kernel, echo=lambda text: None)
        self.kept[key] = lab
        return lab

    def forget(self, lab) -> None:
        """The pool no longer holds ``lab`` (kept for someone, or brought down by a test)."""
        for key, value in list(self.kept.items()):
            if value is lab or getattr(value, "name", None) == getattr(lab, "name", ""):
                del self.kept[key]

    def hand_over(self, lab):
        """The pool's current lab becomes the caller's, who stops it: a test that ends a lab
        asks for its topology's fixture and ``labs`` (so it runs last of that topology)."""
        assert lab is self.current, "hand_over() takes the pool's current lab"
        self.current = None
        return lab

    def close_detached(self) -> None:
        from .lab.fm import registry

        running = {r.name for r in registry.records()}
        for lab in self.kept.values():
            if isinstance(lab, RunningLab):
                lab.down()   # disconnects; brings it down if it is still registered
            elif lab.name in running:
                lab.down()
        self.kept.clear()

    def close(self) -> None:
        """Stop the in-process lab (detached ones stay kept)."""
        if self.current:
            self.current.stop()
            self.current = None

    def close_all(self) -> None:
        self.close()
        self.close_detached()


@pytest.fixture(scope="session")
def lab_pool():
    """The session's labs (LabPool); whatever is still up at the end is brought down."""
    pool = LabPool()
    yield pool
    pool.close_all()


@pytest.fixture
def lab(request, lab_pool) -> RunningLab:
    """The booted lab of the test's ``@pytest.mark.lab(TOPOLOGY, kernel=None)`` (RunningLab)."""
    key = lab_key(request.node)
    if key is None:
        raise pytest.UsageError(f"{request.node.nodeid} uses the `lab` fixture without a lab marker: "
                                'add @pytest.mark.lab("TOPOLOGY") (e.g. "single")')
    running = lab_pool.running(*key)
    yield running
    reports = request.node.stash.get(REPORTS, {})
    failed = any(r.failed for r in reports.values())
    if not failed:
        return
    lab_pool.forget(running)   # a failed test's lab is nobody's to reuse
    if request.config.getoption("--lab-keep"):
        running.disconnect()
        request.config.stash[KEPT].append((request.node.nodeid, running.how_to_reach()))
    else:
        running.down()


def pytest_sessionfinish(session):
    """A pytest-xdist worker hands the labs it left up to its controller, which prints them."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        output[KEPT_OUTPUT] = session.config.stash.get(KEPT, [])


@pytest.hookimpl(optionalhook=True)   # pytest-xdist's hook, on its controller
def pytest_testnodedown(node, error):
    kept = getattr(node, "workeroutput", {}).get(KEPT_OUTPUT, [])
    node.config.stash.setdefault(KEPT, []).extend(tuple(entry) for entry in kept)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    kept = config.stash.get(KEPT, [])
    if not kept:
        return
    terminalreporter.section("vfio-cxl labs left up (--lab-keep)")
    for nodeid, how_to_reach in kept:
        terminalreporter.write_line(f"{nodeid} failed; {how_to_reach}")
