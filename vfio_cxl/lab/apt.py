"""Debian packages for the lab: the host's own apt, and a private apt for trixie.

The host (Debian 12) must not learn about trixie: its sources stay as they
are.  Everything from trixie -- the QEMU runtime, the guest kernel, kernel
headers -- goes through a *private* apt configuration (own sources.list, state
and cache directories) that is handed to one subprocess at a time through its
environment.  It is never exported into a process that runs the host's apt:
with an empty private status file, apt believes nothing is installed and
would have dpkg "install" a whole trixie base system over the host.

The Debian mirror is the one the host's apt already uses, unless
``VFIO_CXL_DEBIAN_MIRROR`` names another.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from ..errors import LabError

MIRROR_ENV = "VFIO_CXL_DEBIAN_MIRROR"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"


def _deb822_uris(text: str) -> list[tuple[str, list[str]]]:
    """(URI, suites) for each stanza of a deb822 ``.sources`` file."""
    found = []
    for stanza in text.split("\n\n"):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line.startswith("#") or ":" not in line or line[:1].isspace():
                continue
            key, _, value = line.partition(":")
            fields[key.strip().lower()] = value.strip()
        if "deb" in fields.get("types", "").split() and "uris" in fields:
            for uri in fields["uris"].split():
                found.append((uri, fields.get("suites", "").split()))
    return found


def _one_line_uris(text: str) -> list[tuple[str, list[str]]]:
    """(URI, [suite]) for each ``deb`` line of a one-line-style sources.list."""
    found = []
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if not words or words[0] != "deb":
            continue
        words = [w for w in words[1:] if not w.startswith("[")]
        # Drop a "[opt=val ...]" block that spans several words.
        while words and "]" in words[0] and "=" in words[0]:
            words.pop(0)
        if len(words) >= 2:
            found.append((words[0], [words[1]]))
    return found


def host_mirror(etc_apt: Path = Path("/etc/apt")) -> str:
    """The Debian archive URI the host's apt uses (not its security archive)."""
    override = os.environ.get(MIRROR_ENV)
    if override:
        return override.rstrip("/")
    candidates: list[tuple[str, list[str]]] = []
    parts = etc_apt / "sources.list.d"
    for path in sorted(parts.glob("*.sources")) if parts.is_dir() else []:
        candidates += _deb822_uris(path.read_text(errors="replace"))
    for path in [etc_apt / "sources.list", *(sorted(parts.glob("*.list")) if parts.is_dir() else [])]:
        if path.is_file():
            candidates += _one_line_uris(path.read_text(errors="replace"))
    for uri, suites in candidates:
        if uri.rstrip("/").endswith("/debian") and not any("security" in s for s in suites):
            return uri.rstrip("/")
    raise LabError(
        "cannot find a Debian mirror in the host's apt sources",
        f"set {MIRROR_ENV} to the URI of a Debian archive",
    )


def clean_host_env() -> dict[str, str]:
    """The environment for the host's own apt/dpkg: never a private APT_CONFIG."""
    env = dict(os.environ)
    env.pop("APT_CONFIG", None)
    env["DEBIAN_FRONTEND"] = "noninteractive"
    return env


def missing_host_packages(names: list[str]) -> list[str]:
    missing = []
    for name in names:
        result = subprocess.run(
            ["dpkg-query", "-W", "-f=${db:Status-Status}", name],
            capture_output=True, text=True, env=clean_host_env(),
        )
        if result.stdout.strip() != "installed":
            missing.append(name)
    return missing


def ensure_host_packages(names: list[str], log=print) -> None:
    """Install the host packages the lab needs, with the host's own apt."""
    missing = missing_host_packages(names)
    if not missing:
        return
    if os.geteuid() != 0:
        raise LabError(
            f"missing host packages: {' '.join(missing)}",
            f"run as root, or first: sudo apt-get install {' '.join(missing)}",
        )
    log(f"installing host packages: {' '.join(missing)}")
    env = clean_host_env()
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *missing]):
        result = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).splitlines()[-5:])
            raise LabError(f"'{' '.join(cmd)}' failed:\n{tail}", "fix the host's apt, then run again")


class PrivateApt:
    """A self-contained apt configuration for some Debian suites.

    Only ``download``/``update`` use it, through the environment of their own
    subprocess; ``apt_lines`` gives the same sources to mmdebstrap.
    """

    def __init__(self, root: Path, suites: list[str], mirror: str | None = None):
        self.root = root
        self.suites = suites
        self.mirror = mirror or host_mirror()
        self._updated = False
        for sub in ("lists/partial", "cache/archives/partial", "etc"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        (root / "status").touch()
        (root / "etc" / "sources.list").write_text("".join(line + "\n" for line in self.apt_lines()))
        (root / "etc" / "apt.conf").write_text(
            f'Dir::State "{root}";\n'
            f'Dir::State::Lists "{root}/lists";\n'
            f'Dir::State::status "{root}/status";\n'
            f'Dir::Cache "{root}/cache";\n'
            f'Dir::Etc::SourceList "{root}/etc/sources.list";\n'
            f'Dir::Etc::SourceParts "{root}/etc";\n'
            f'Dir::Etc::Preferences "{root}/etc/preferences";\n'
            f'Dir::Etc::PreferencesParts "{root}/etc";\n'
            'APT::Sandbox::User "root";\n'
        )

    def apt_lines(self) -> list[str]:
        signed = f" [signed-by={KEYRING}]" if Path(KEYRING).exists() else ""
        return [f"deb{signed} {self.mirror} {suite} main" for suite in self.suites]

    def _run(self, args: list[str], cwd: Path | None = None) -> str:
        env = clean_host_env()
        env["APT_CONFIG"] = str(self.root / "etc" / "apt.conf")
        result = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True)
        if result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).splitlines()[-5:])
            raise LabError(f"'{' '.join(args)}' failed:\n{tail}", "check the network and the Debian mirror")
        return result.stdout

    def update(self) -> None:
        if not self._updated:
            self._run(["apt-get", "update", "-q"])
            self._updated = True

    def resolve(self, name: str) -> str:
        """The concrete package a virtual or meta name depends on (e.g. linux-image-amd64)."""
        self.update()
        for line in self._run(["apt-cache", "depends", name]).splitlines():
            line = line.strip()
            if line.startswith("Depends:"):
                return line.split()[1]
        return name

    def show(self, name: str) -> str:
        """``apt-cache show`` of the candidate version of ``name``."""
        self.update()
        return self._run(["apt-cache", "show", "--no-all-versions", name])

    def download(self, names: list[str], dest: Path) -> list[Path]:
        """Download .deb files (no install) into ``dest``; returns their paths."""
        self.update()
        dest.mkdir(parents=True, exist_ok=True)
        before = set(dest.glob("*.deb"))
        self._run(["apt-get", "download", "-q", *names], cwd=dest)
        return sorted(set(dest.glob("*.deb")) - before) or sorted(dest.glob("*.deb"))


def extract_deb(deb: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(["dpkg-deb", "-x", str(deb), str(dest)], check=True)


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
