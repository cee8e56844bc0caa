"""The matrix file: axes, include/exclude, runs -> cells -> jobs, all checked before anything starts.

    [axes]
    kernel = ["debian", "lab"]        # 'debian' (the image's), 'lab', or a kernel file
    topology = ["single", "hb2"]      # shipped names or .toml files
    backend = ["type1", "iommufd"]    # optional

    [[exclude]]                       # drop every combination matching all these keys
    kernel = "debian"
    backend = "iommufd"

    [[include]]                       # add combinations (a list value: each of them)
    kernel = "lab"
    topology = "p2p"

    [[run]]
    name = "uname"
    guest = { vm = "host0", command = "uname -r" }
    timeout = 300                     # seconds, per attempt
    retries = 0                       # extra attempts after a failure (not after a lost node)

A run is one of ``guest`` (a shell command in a named VM of the cell's lab), ``selftest`` (the
kernel's VFIO selftests: ``vfio-cxl selftest vfio``), ``tests`` (a selection of the project's VM
tests) or ``bench`` (a benchmark with its arguments).  Which axes a run spans follows from what
it is (:data:`AXES_OF`): a selftest boots its own ``selftest`` topology, VM tests and
benchmarks boot their own labs, so those run once per kernel/backend, or once.

Problems are :class:`LabError` naming the file, the key or the cell, and what would be right.
The rules are documented in ``docs/matrix.md``.
"""

from __future__ import annotations

import itertools
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import LabError
from ..lab import topology as topologies
from ..lab.kconfig import parse_config, read_kernel_config
from ..lab.kernel import FRAGMENT
from ..lab.topology import parse_size

KERNELS = ("debian", "lab")
BACKENDS = ("type1", "iommufd")
AXES = ("kernel", "topology", "backend")
# Which axes each kind of run spans; the others do not apply to it (it boots its own labs).
AXES_OF = {"guest": ("kernel", "topology", "backend"),
           "selftest": ("kernel", "backend"),
           "tests": (),
           "bench": ()}
SELFTEST_TOPOLOGY = "selftest"
DEFAULT_TIMEOUT = 1800
MAX_RETRIES = 5
_NAME = r"^[a-z0-9][a-z0-9_.-]{0,39}$"


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GuestRun(_Table):
    vm: str = Field(min_length=1)
    command: str = Field(min_length=1)


class SelftestRun(_Table):
    suite: Literal["vfio"] = "vfio"
    k: list[str] = []


class TestsRun(_Table):
    select: list[str] = Field(min_length=1)   # pytest node ids or paths under tests/vm
    k: str | None = None


class BenchRun(_Table):
    name: str = Field(min_length=1)
    args: list[str] = []


class Resources(_Table):
    tcg_vm: int | None = Field(default=None, ge=1)   # default: the number of VMs the lab boots
    num_cpus: float = Field(default=1, gt=0)
    memory: str | int | None = None                  # default: the VMs' memory + 512M each

    @field_validator("memory")
    @classmethod
    def _memory(cls, value):
        if value is not None:
            parse_size(value, "memory")
        return value


class Run(_Table):
    name: str = Field(pattern=_NAME)
    guest: GuestRun | None = None
    selftest: SelftestRun | None = None
    tests: TestsRun | None = None
    bench: BenchRun | None = None
    timeout: float = Field(default=DEFAULT_TIMEOUT, gt=0)
    retries: int = Field(default=0, ge=0, le=MAX_RETRIES)
    resources: Resources = Resources()

    @model_validator(mode="after")
    def _one_kind(self):
        kinds = [k for k in AXES_OF if getattr(self, k) is not None]
        if len(kinds) != 1:
            raise ValueError(f"a run is exactly one of {', '.join(AXES_OF)} (got "
                             f"{', '.join(kinds) or 'none'})")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in AXES_OF if getattr(self, k) is not None)


_Values = str | list[str]


class Axes(_Table):
    kernel: list[str] = ["debian"]
    topology: list[str] = ["single"]
    backend: list[str] = []


class Pattern(_Table):
    """An include or exclude entry: values per axis (a string or a list), and the run."""
    kernel: _Values | None = None
    topology: _Values | None = None
    backend: _Values | None = None
    run: _Values | None = None

    def values(self, key: str) -> list[str] | None:
        value = getattr(self, key)
        return [value] if isinstance(value, str) else value


class MatrixFile(_Table):
    name: str | None = Field(default=None, pattern=_NAME)
    axes: Axes = Axes()
    include: list[Pattern] = []
    exclude: list[Pattern] = []
    run: list[Run] = []


@dataclass(frozen=True)
class Matrix:
    name: str
    source: Path
    file: MatrixFile

    @property
    def runs(self) -> dict[str, Run]:
        return {r.name: r for r in self.file.run}


@dataclass(frozen=True)
class Cell:
    run: str
    kernel: str | None = None
    topology: str | None = None
    backend: str | None = None

    @property
    def label(self) -> str:
        parts = [self.run] + [f"{k}={v}" for k in AXES if (v := getattr(self, k)) is not None]
        return " ".join(parts)

    @property
    def key(self) -> str:
        """A short id for files and test ids: run-kernel-topology-backend."""
        parts = [self.run] + [Path(v).stem if "/" in v else v
                              for k in AXES if (v := getattr(self, k)) is not None]
        return re.sub(r"[^A-Za-z0-9_.-]+", "_", "-".join(parts))


@dataclass
class Job:
    """One cell's work, self-contained: what a node needs to run it, and nothing of the driver."""
    cell: Cell
    kind: str
    spec: dict                          # the run's guest/selftest/tests/bench table
    timeout: float
    retries: int
    resources: dict                     # Ray resources: num_cpus, memory, {"tcg_vm": N}
    kernel_path: str | None = None      # for a kernel file: its absolute path on the driver
    recipes: dict = field(default_factory=dict)   # filled in by recipes.of(job)

    @property
    def id(self) -> str:
        return self.cell.key

    def to_dict(self) -> dict:
        return {"id": self.id, "cell": self.cell.__dict__, "kind": self.kind, "spec": self.spec,
                "timeout": self.timeout, "retries": self.retries, "resources": self.resources,
                "kernel_path": self.kernel_path, "recipes": self.recipes}


# ---------------------------------------------------------------- parsing

def _from_pydantic(err: ValidationError, source: str) -> LabError:
    lines = []
    for e in err.errors():
        loc = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in e["loc"]).replace(".[", "[")
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        elif e["type"] == "missing":
            msg = "required key is missing"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        lines.append(f"{source}: {loc or '(top level)'}: {msg}")
    return LabError("\n".join(lines), "see docs/matrix.md for every key")


def parse(text: str, source: str = "<matrix>", base: Path | None = None) -> Matrix:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise LabError(f"{source}: malformed TOML: {err}", "fix the file's syntax") from None
    try:
        file = MatrixFile.model_validate(data)
    except ValidationError as err:
        raise _from_pydantic(err, source) from None
    path = Path(source)
    return Matrix(file.name or re.sub(r"[^a-z0-9_.-]", "-", path.stem.lower()) or "matrix",
                  base or path.parent, file)


def load(path: str | Path) -> Matrix:
    path = Path(path)
    if not path.is_file():
        raise LabError(f"no matrix file {path}", "give the path of a .toml matrix file (see docs/matrix.md)")
    return parse(path.read_text(), str(path), path.resolve().parent)


# ---------------------------------------------------------------- checking and expanding

def _kernel_file(value: str, base: Path) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() else base / path


def kernel_has_iommufd(kernel: str, base: Path = Path(".")) -> bool:
    """Whether a kernel axis value has the iommufd VFIO backend (IOMMUFD and VFIO_DEVICE_CDEV),
    read from its config: the lab kernel's fragment, the image's config, or the file's."""
    if kernel == "lab":
        config = parse_config(FRAGMENT.read_text())
    elif kernel == "debian":
        from ..lab.image import image_path
        found = image_path() / "config"
        # The image's Debian kernel loads only the modules the image lists: no iommufd among them.
        config = parse_config(found.read_text()) if found.is_file() else {}
        config = {k: v for k, v in config.items() if v == "y"}
    else:
        config = read_kernel_config(_kernel_file(kernel, base))
    return config.get("IOMMUFD") == "y" and config.get("VFIO_DEVICE_CDEV") == "y"


def _check_axis_values(matrix: Matrix, key: str, values: list[str], where: str) -> None:
    for value in values:
        if key == "kernel" and value not in KERNELS and not _kernel_file(value, matrix.source).is_file():
            raise LabError(f"{where}: unknown kernel {value!r}",
                           f"use {', '.join(KERNELS)} or the path of a kernel file (bzImage, or vmlinux "
                           f"with CONFIG_PVH=y; relative to {matrix.source})")
        if key == "topology":
            try:
                topologies.resolve(value if not value.endswith(".toml") else str(_kernel_file(value, matrix.source)))
            except LabError as err:
                raise LabError(f"{where}: {err.what}", err.fix) from None
        if key == "backend" and value not in BACKENDS:
            raise LabError(f"{where}: unknown backend {value!r}", f"use one of: {', '.join(BACKENDS)}")
        if key == "run" and value not in matrix.runs:
            raise LabError(f"{where}: no [[run]] named {value!r}",
                           f"runs: {', '.join(matrix.runs) or 'none'}")


def combinations(matrix: Matrix) -> list[dict]:
    """The axes' product with every run, less the excludes, plus the includes (CI-matrix style)."""
    f = matrix.file
    axes = {"kernel": f.axes.kernel, "topology": f.axes.topology,
            "backend": f.axes.backend or [None], "run": list(matrix.runs)}
    for key in AXES:
        _check_axis_values(matrix, key, [v for v in axes[key] if v is not None], f"axes.{key}")
        if not axes[key]:
            raise LabError(f"{matrix.source}: axes.{key} is empty", f"give at least one {key}, or leave the key out")
    for kind, patterns in (("exclude", f.exclude), ("include", f.include)):
        for i, pattern in enumerate(patterns):
            for key in (*AXES, "run"):
                if pattern.values(key) is not None:
                    _check_axis_values(matrix, key, pattern.values(key), f"{kind}[{i}].{key}")
    keys = list(axes)
    combos = [dict(zip(keys, values)) for values in itertools.product(*axes.values())]

    def matches(combo: dict, pattern: Pattern) -> bool:
        return all(combo[k] in vals for k in keys if (vals := pattern.values(k)) is not None)

    combos = [c for c in combos if not any(matches(c, p) for p in f.exclude)]
    for pattern in f.include:
        extra = {k: pattern.values(k) or axes[k] for k in keys}
        for values in itertools.product(*extra.values()):
            combo = dict(zip(keys, values))
            if combo not in combos:
                combos.append(combo)
    return combos


def expand(matrix: Matrix) -> list[Job]:
    """The matrix's jobs, one per cell, each checked: every problem fails here, naming the cell."""
    if not matrix.runs:
        raise LabError(f"{matrix.source}: no [[run]] in the matrix",
                       "add at least one [[run]] with a name and one of guest, selftest, tests, bench")
    cells: list[Cell] = []
    for combo in combinations(matrix):
        run = matrix.runs[combo["run"]]
        kept = {k: combo[k] for k in AXES_OF[run.kind]}
        if run.kind == "selftest":
            kept["topology"] = SELFTEST_TOPOLOGY
        cell = Cell(run=run.name, **kept)
        if cell not in cells:
            cells.append(cell)
    if not cells:
        raise LabError(f"{matrix.source}: the matrix is empty (every combination is excluded)",
                       "remove an [[exclude]] or add an [[include]]")
    keys = [c.key for c in cells]
    dupes = sorted({k for k in keys if keys.count(k) > 1})
    if dupes:
        raise LabError(f"{matrix.source}: two cells share the id {dupes[0]!r}",
                       "give kernel and topology files distinct names")
    iommufd: dict[str, bool] = {}
    jobs = []
    for cell in cells:
        run = matrix.runs[cell.run]
        jobs.append(_job(matrix, cell, run, iommufd))
    return jobs


def _job(matrix: Matrix, cell: Cell, run: Run, iommufd: dict[str, bool]) -> Job:
    where = f"{matrix.source}: cell [{cell.label}]"
    vms = 1
    memory = 0
    if cell.topology is not None:
        topo_name = cell.topology if not cell.topology.endswith(".toml") else \
            str(_kernel_file(cell.topology, matrix.source))
        try:
            topo = topologies.load(topo_name)
        except LabError as err:
            raise LabError(f"{where}: {err.what}", err.fix) from None
        names = [vm.name for vm in topo.vms]
        if run.guest is not None and run.guest.vm not in names:
            raise LabError(f"{where}: topology {cell.topology} has no VM {run.guest.vm!r} "
                           f"(run {run.name} runs its command there)",
                           f"its VMs: {', '.join(names)}; exclude the cell: [[exclude]] topology = "
                           f"\"{cell.topology}\" run = \"{run.name}\"")
        vms = len(topo.vms)
        memory = sum(vm.memory for vm in topo.vms)
    if cell.backend == "iommufd" and cell.kernel is not None:
        if cell.kernel not in iommufd:
            try:
                iommufd[cell.kernel] = kernel_has_iommufd(cell.kernel, matrix.source)
            except LabError as err:
                raise LabError(f"{where}: {err.what}", err.fix) from None
        if not iommufd[cell.kernel]:
            raise LabError(f"{where}: backend iommufd on kernel {cell.kernel}, which has no IOMMUFD "
                           "(CONFIG_IOMMUFD=y and CONFIG_VFIO_DEVICE_CDEV=y)",
                           f"use kernel lab, or exclude the cell: [[exclude]] kernel = \"{cell.kernel}\" "
                           "backend = \"iommufd\"")
    res = run.resources
    resources = {"num_cpus": res.num_cpus,
                 "memory": parse_size(res.memory) if res.memory is not None else memory + vms * (512 << 20),
                 "resources": {"tcg_vm": res.tcg_vm or vms}}
    kernel_path = None
    if cell.kernel is not None and cell.kernel not in KERNELS:
        kernel_path = str(_kernel_file(cell.kernel, matrix.source).resolve())
    spec = getattr(run, run.kind).model_dump()
    if cell.topology is not None:   # the topology travels with the job: a file need not be on the node
        path = topologies.resolve(cell.topology if not cell.topology.endswith(".toml")
                                  else str(_kernel_file(cell.topology, matrix.source)))
        spec["topology"] = {"name": path.stem, "toml": path.read_text()}
    return Job(cell=cell, kind=run.kind, spec=spec, timeout=run.timeout, retries=run.retries,
               resources=resources, kernel_path=kernel_path)
