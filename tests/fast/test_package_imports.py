"""The package's import graph, read from the source with ``ast`` (nothing heavy is imported).

* No import circle anywhere in ``vfio_cxl/``: a module's top-level imports (those
  that run when it is imported, ``if TYPE_CHECKING:`` blocks included) never lead
  back to it.
* The guest library (``vfio_cxl.guest`` apart from ``vfio_cxl.guest.cmd``) never
  imports the commands built on it, not even lazily inside a function; and
  importing every library module for real leaves ``vfio_cxl.guest.cmd`` out of
  ``sys.modules``.
* Every module is in one room (``ROOMS``) and imports, even lazily, only from its own
  room and the rooms below it (``MAY_IMPORT``): commands (the CLI entry, benches, demos,
  the guest's commands, the pytest plugin) above the libraries; the host lab above the
  devices; the devices and the guest library above what both sides share (the kernel's
  VFIO ABI, the register maps, ``errors``, ``paths``).  The package root holds only the
  CLI entry, ``paths``, ``errors``, the shared ABI and the pytest plugin.
"""

import ast
import json
import subprocess
import sys
from pathlib import Path

import vfio_cxl

PACKAGE_DIR = Path(vfio_cxl.__file__).parent
COMMANDS = "vfio_cxl.guest.cmd"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE_DIR.rglob("*.py")}


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def imported(name: str, node: ast.AST) -> list[str]:
    """The package modules one import statement of module ``name`` loads."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        if node.level:
            base = name.split(".") if is_package(name) else name.split(".")[:-1]
            base = base[:len(base) - (node.level - 1)]
            prefix = ".".join(base + ([node.module] if node.module else []))
        else:
            prefix = node.module
        targets = [f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in MODULES else prefix
                   for alias in node.names]
    out = []
    for target in targets:
        while target and target not in MODULES:   # `import a.b.c` of a name inside a module
            target = target.rpartition(".")[0]
        if target:
            out.append(target)
    return out


def imports(name: str, top_level_only: bool) -> set[str]:
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.update(imported(name, child))
            elif top_level_only and isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            else:
                visit(child)
    visit(tree)
    found.discard(name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (a list of modules, first == last), or None."""
    state: dict[str, int] = {}          # 1: on the current path, 2: done
    path: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := dfs(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := dfs(start)):
            return cycle
    return None


def test_the_walk_sees_relative_and_absolute_imports():
    graph = {name: imports(name, top_level_only=True) for name in MODULES}
    assert "vfio_cxl.guest.vfio.iommu" in graph["vfio_cxl.guest.vfio.container"]
    assert "vfio_cxl.devices.gpu.regs" in graph["vfio_cxl.guest.drivers.gpu"]
    assert "vfio_cxl.guest.channel" in graph["vfio_cxl.guest.smc_channel"]
    assert {"vfio_cxl.guest.cmd.demo_dma"} <= imports("vfio_cxl.guest.cmd.cli", top_level_only=False)


def test_the_cycle_finder_finds_a_circle_through_a_type_checking_import():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .container import Container\n")
    tree = ast.parse(source)
    nodes = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
    assert imported("vfio_cxl.guest.vfio.dma", nodes[0]) == ["vfio_cxl.guest.vfio.container"]


def test_no_import_circle_in_the_package():
    graph = {name: imports(name, top_level_only=True) for name in MODULES}
    assert find_cycle(graph) is None, f"import circle: {' -> '.join(find_cycle(graph))}"


def library_modules() -> list[str]:
    return sorted(name for name in MODULES
                  if name.startswith("vfio_cxl.guest") and not name.startswith(COMMANDS))


def test_the_guest_library_never_imports_the_commands():
    graph = {name: imports(name, top_level_only=False) for name in MODULES}
    library = library_modules()
    assert "vfio_cxl.guest.vfio.pci" in library and "vfio_cxl.guest.drivers.gpu" in library
    assert f"{COMMANDS}.cli" in MODULES and f"{COMMANDS}.cli" not in library
    offenders = {}
    for start in library:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt)
                todo.append(nxt)
        if hits := sorted(m for m in seen if m == COMMANDS or m.startswith(COMMANDS + ".")):
            offenders[start] = hits
    assert not offenders, f"library modules reaching the commands: {offenders}"


def test_importing_every_library_module_loads_no_command():
    """...and every public name a library module lists in ``__all__`` is there (the
    package's own lazily loaded names included)."""
    script = ("import importlib, json, sys\n"
              "missing = []\n"
              f"for name in {library_modules()!r}:\n"
              "    module = importlib.import_module(name)\n"
              "    missing += [f'{name}.{n}' for n in getattr(module, '__all__', ()) if not hasattr(module, n)]\n"
              "listed = {m: hasattr(importlib.import_module(m), '__all__') for m in "
              f"{library_modules()!r}}}\n"
              "loaded = sorted(m for m in sys.modules if m.startswith('vfio_cxl'))\n"
              "print(json.dumps({'loaded': loaded, 'missing': missing, 'listed': listed}))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE_DIR.parent)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert "vfio_cxl.guest.drivers.gpu" in result["loaded"] and "vfio_cxl.guest.channel" in result["loaded"]
    assert [m for m in result["loaded"] if m.startswith(COMMANDS)] == []
    assert result["missing"] == []
    public = ["vfio_cxl.guest", "vfio_cxl.guest.vfio", "vfio_cxl.guest.cxl", "vfio_cxl.guest.dax",
              "vfio_cxl.guest.drivers", "vfio_cxl.guest.drivers.gpu", "vfio_cxl.guest.drivers.smc",
              "vfio_cxl.guest.drivers.nvme", "vfio_cxl.guest.storage", "vfio_cxl.guest.channel",
              "vfio_cxl.guest.smc_channel", "vfio_cxl.guest.p2p", "vfio_cxl.guest.gpumem"]
    assert [m for m in public if not result["listed"][m]] == [], "public modules without __all__"


def test_the_image_s_wrapper_runs_the_guest_command():
    """The guest image's /usr/local/bin/vfio-cxl runs `python3 -m vfio_cxl.guest.cmd.cli`."""
    wrapper = (PACKAGE_DIR.parent / "images/rootfs/usr/local/bin/vfio-cxl").read_text()
    assert f"exec python3 -m {COMMANDS}.cli " in wrapper, wrapper
    assert f"{COMMANDS}.cli" in MODULES


# -- rooms and floors ----------------------------------------------------------------------------
SHARED = "shared"               # what both sides import: the kernel's VFIO ABI, the register maps, errors, paths
HOST_LIBRARIES = {"host lab", "matrix", "devices", "guest library", SHARED}

# Module (exact name) or package (every module below it; the longest match wins) -> its room.
ROOMS = {
    "vfio_cxl": SHARED, "vfio_cxl.errors": SHARED, "vfio_cxl.paths": SHARED, "vfio_cxl.vfio_abi": SHARED,
    "vfio_cxl.devices.gpu.regs": SHARED, "vfio_cxl.devices.smc.regs": SHARED,
    # the package's __init__ installs it in every process (a no-op without $VFIO_CXL_PYC)
    "vfio_cxl.guest.bytecode": SHARED,
    "vfio_cxl.devices.": "devices",
    "vfio_cxl.guest.": "guest library",
    "vfio_cxl.lab.": "host lab",
    "vfio_cxl.matrix.": "matrix",
    "vfio_cxl.guest.cmd.": "guest commands",
    "vfio_cxl.bench.": "benches",
    "vfio_cxl.demos.": "demos",
    "vfio_cxl.pytest_plugin": "pytest plugin",
    "vfio_cxl.cli": "CLI entry", "vfio_cxl.__main__": "CLI entry",
}

# Room -> the rooms its modules may import besides their own.
MAY_IMPORT = {
    SHARED: set(),
    "devices": {SHARED},
    "guest library": {SHARED},
    "host lab": {"devices", SHARED},
    "matrix": {"host lab", "devices", SHARED},
    "guest commands": {"guest library", SHARED},       # they run in the guest: no host code
    "benches": HOST_LIBRARIES,
    "demos": HOST_LIBRARIES,                            # guest commands run by name over SSH, not imported
    "pytest plugin": HOST_LIBRARIES,
    "CLI entry": HOST_LIBRARIES | {"demos"},
}

ROOT_MODULES = {"vfio_cxl", "vfio_cxl.__main__", "vfio_cxl.cli", "vfio_cxl.paths", "vfio_cxl.errors",
                "vfio_cxl.vfio_abi", "vfio_cxl.pytest_plugin"}


def room_of(name: str) -> str | None:
    """The room of module ``name``, or None if ``ROOMS`` places it nowhere."""
    if name in ROOMS:
        return ROOMS[name]
    packages = [p for p in ROOMS if p.endswith(".") and (name + ".").startswith(p)]
    return ROOMS[max(packages, key=len)] if packages else None


def room_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every (importer, imported) pair of ``graph`` that imports a room its room may not (a module
    in no room may import nothing outside it)."""
    return sorted((name, target) for name, targets in graph.items() for target in targets
                  if room_of(target) != room_of(name)
                  and room_of(target) not in MAY_IMPORT.get(room_of(name), set()))


def full_graph() -> dict[str, set[str]]:
    return {name: imports(name, top_level_only=False) for name in MODULES}


def test_every_module_is_in_a_room_and_every_room_has_its_floor():
    unplaced = sorted(name for name in MODULES if room_of(name) is None)
    assert not unplaced, f"modules in no room (add them to ROOMS): {unplaced}"
    assert set(ROOMS.values()) == set(MAY_IMPORT), "every room says what it may import"
    assert room_of("vfio_cxl.guest.cmd.cli") == "guest commands" and room_of("vfio_cxl.guest.cacheline") == "guest library"
    assert room_of("vfio_cxl.devices.gpu.regs") == SHARED and room_of("vfio_cxl.devices.gpu.engine") == "devices"
    assert room_of("vfio_cxl.some_new_module") is None


def test_the_package_root_holds_only_the_cli_entry_paths_errors_the_abi_and_the_plugin():
    at_root = {name for name in MODULES if name.count(".") == 1 and not is_package(name)} | {"vfio_cxl"}
    assert at_root <= ROOT_MODULES, f"modules at the package root that belong in a room: {sorted(at_root - ROOT_MODULES)}"


def test_no_import_goes_to_a_room_above_or_beside_its_own():
    violations = room_violations(full_graph())
    assert not violations, "imports across the floors:\n" + "\n".join(
        f"  {a} ({room_of(a)}) -> {b} ({room_of(b)})" for a, b in violations)


def test_the_room_check_catches_planted_violations():
    planted = {("vfio_cxl.guest.drivers.gpu", "vfio_cxl.lab.ssh"),            # guest library -> host lab
               ("vfio_cxl.devices.gpu.engine", "vfio_cxl.guest.channel"),     # devices -> guest library
               ("vfio_cxl.devices.gpu.regs", "vfio_cxl.devices.gpu.engine"),  # a register map -> the model
               ("vfio_cxl.lab.lab", "vfio_cxl.demos.dma"),                    # library -> command
               ("vfio_cxl.bench.share", "vfio_cxl.demos.share"),              # bench -> demo
               ("vfio_cxl.demos.dma", "vfio_cxl.guest.cmd.demo_dma"),         # host demo -> guest command
               ("vfio_cxl.guest.cmd.stream", "vfio_cxl.lab.ssh")}             # guest command -> host lab
    graph = full_graph()
    for importer, imported in planted:
        graph[importer] = graph[importer] | {imported}
    assert set(room_violations(graph)) == planted
    allowed = {("vfio_cxl.bench.channel", "vfio_cxl.guest.channel"), ("vfio_cxl.cli", "vfio_cxl.demos"),
               ("vfio_cxl.guest.drivers.smc", "vfio_cxl.devices.smc.regs")}
    for importer, imported in allowed:
        graph[importer] = graph[importer] | {imported}
    assert set(room_violations(graph)) == planted


def test_the_walk_sees_the_imports_the_room_check_relies_on():
    graph = full_graph()
    assert "vfio_cxl.guest.cacheline" in graph["vfio_cxl.bench.channel"]   # lazy, inside a function
    assert "vfio_cxl.devices.gpu.regs" in graph["vfio_cxl.devices.smc.regs"]
    assert "vfio_cxl.lab.record_stream" in graph["vfio_cxl.bench.share"]
