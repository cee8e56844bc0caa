"""The Debian mirror comes from the host's apt sources (a fake /etc/apt here)."""

import pytest

from vfio_cxl.errors import LabError
from vfio_cxl.lab import apt


def test_mirror_from_deb822(tmp_path, monkeypatch):
    monkeypatch.delenv(apt.MIRROR_ENV, raising=False)
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\n\n"
        "Types: deb\n# comment\nURIs: http://mirror.example/debian/\nSuites: bookworm bookworm-updates\n"
        "Components: main\n")
    assert apt.host_mirror(tmp_path) == "http://mirror.example/debian"


def test_mirror_from_one_line_sources(tmp_path, monkeypatch):
    monkeypatch.delenv(apt.MIRROR_ENV, raising=False)
    (tmp_path / "sources.list").write_text(
        "# deb http://old.example/debian stretch main\n"
        "deb [arch=amd64 signed-by=/k.gpg] http://m.example/debian bookworm main\n")
    assert apt.host_mirror(tmp_path) == "http://m.example/debian"


def test_mirror_override_and_missing(tmp_path, monkeypatch):
    monkeypatch.setenv(apt.MIRROR_ENV, "http://override.example/debian/")
    assert apt.host_mirror(tmp_path) == "http://override.example/debian"
    monkeypatch.delenv(apt.MIRROR_ENV)
    with pytest.raises(LabError, match=apt.MIRROR_ENV):
        apt.host_mirror(tmp_path)


def test_host_apt_never_sees_a_private_config(monkeypatch):
    # A private APT_CONFIG (empty status file) reaching the host's apt would make
    # it reinstall a whole base system over the host.
    monkeypatch.setenv("APT_CONFIG", "/tmp/private/apt.conf")
    assert "APT_CONFIG" not in apt.clean_host_env()


def test_private_apt_config_is_self_contained(tmp_path, monkeypatch):
    monkeypatch.setenv(apt.MIRROR_ENV, "http://m.example/debian")
    private = apt.PrivateApt(tmp_path, ["trixie", "trixie-backports"])
    conf = (tmp_path / "etc" / "apt.conf").read_text()
    assert f'Dir::State::status "{tmp_path}/status"' in conf
    assert "/etc/apt" not in conf
    lines = (tmp_path / "etc" / "sources.list").read_text().splitlines()
    assert [line.split()[-2] for line in lines] == ["trixie", "trixie-backports"]
    assert private.mirror == "http://m.example/debian"
