"""guest.cxl.bring_up's own logic against a fake cxl-cli/daxctl: which regions it makes, which
it finds already there, what it lists (each call costs ~50 ms in a TCG guest, at every boot), and
that a region it made is destroyed when a later step fails.  The real tools run at every VM
test's boot (Lab.start: `cxltool regions`)."""

from __future__ import annotations

import pytest

from vfio_cxl.guest import cxl

RAM = {"name": "r0", "type": "ram", "window": 0, "granularity": 8192, "use": "devdax", "serials": [4096]}


class FakeCli:
    """cxl list -M / -R / -D, create-region, destroy-region, daxctl enable-device: the JSON they
    print for a guest with memdevs mem0 (serial 0x1000) and mem1 (0x1001) and one root decoder."""

    def __init__(self, fail_dax: bool = False):
        self.calls: list[tuple[str, ...]] = []
        self.regions: dict[str, dict] = {}
        self.fail_dax = fail_dax

    def __call__(self, *argv: str, check: bool = True):
        self.calls.append(argv)
        if argv[:3] == ("cxl", "list", "-M"):
            return [{"memdev": "mem0", "serial": 4096}, {"memdev": "mem1", "serial": 4097}]
        if argv[:4] == ("cxl", "list", "-D", "-d"):
            return [{"decoder": "decoder0.0"}]
        if argv[:5] == ("cxl", "list", "-R", "-X", "-r"):
            name = argv[5]
            return [{**self.regions[name], "daxregion": {"devices": [
                {"chardev": f"dax{name[-1]}.0", "mode": "devdax", "state": "disabled"}]}}]
        if argv[:3] == ("cxl", "list", "-R"):
            return list(self.regions.values())
        if argv[:2] == ("cxl", "create-region"):
            name = f"region{len(self.regions)}"
            mems = list(argv[argv.index("-m") + 1:])
            self.regions[name] = {"region": name, "type": argv[argv.index("-t") + 1], "size": 1 << 28,
                                  "interleave_ways": len(mems), "interleave_granularity": 8192,
                                  "resource": 0x1000000000,
                                  "mappings": [{"memdev": m, "position": i} for i, m in enumerate(mems)]}
            return self.regions[name]
        if argv[:2] == ("cxl", "destroy-region"):
            del self.regions[argv[-1]]
            return []
        if argv[:2] == ("daxctl", "enable-device"):
            if self.fail_dax:
                raise cxl.CxlError(f"'{' '.join(argv)}' failed: no such device")
            return []
        raise AssertionError(f"unexpected call {argv}")


@pytest.fixture
def cli(monkeypatch):
    fake = FakeCli()
    monkeypatch.setattr(cxl, "tool", fake)
    monkeypatch.setattr(cxl, "dax_geometry", lambda name: (1 << 28, 2 << 20))
    return fake


def test_a_ram_region_is_made_and_its_dax_enabled_with_six_calls(cli):
    (made,) = cxl.bring_up({"pmem": False, "regions": [RAM]})
    assert made == {"name": "r0", "region": "region0", "type": "ram", "memdevs": ["mem0"], "size": 1 << 28,
                    "ways": 1, "granularity": 8192, "use": "devdax", "dax": "dax0.0"}
    assert [c[:3] for c in cli.calls] == [("cxl", "list", "-M"), ("cxl", "list", "-R"), ("cxl", "list", "-D"),
                                          ("cxl", "create-region", "-t"), ("cxl", "list", "-R"),
                                          ("daxctl", "enable-device", "dax0.0")]


def test_a_region_already_up_is_found_not_made_again(cli):
    cxl.bring_up({"pmem": False, "regions": [RAM]})
    cli.calls.clear()
    (again,) = cxl.bring_up({"pmem": False, "regions": [RAM]})
    assert again["region"] == "region0" and list(cli.regions) == ["region0"]
    assert not any(c[1] == "create-region" for c in cli.calls)


def test_a_second_region_is_looked_up_in_a_listing_made_after_the_first(cli):
    second = {**RAM, "name": "r1", "serials": [4097]}
    made = cxl.bring_up({"pmem": False, "regions": [RAM, second]})
    assert [m["region"] for m in made] == ["region0", "region1"]
    assert [c for c in cli.calls if c[:3] == ("cxl", "list", "-R") and "-r" not in c] == [
        ("cxl", "list", "-R", "-X", "-T")] * 2


def test_a_region_made_is_destroyed_when_its_dax_cannot_be_enabled(monkeypatch):
    fake = FakeCli(fail_dax=True)
    monkeypatch.setattr(cxl, "tool", fake)
    with pytest.raises(cxl.CxlError, match="enable-device"):
        cxl.bring_up({"pmem": False, "regions": [RAM]})
    assert fake.regions == {} and fake.calls[-1] == ("cxl", "destroy-region", "-f", "region0")


def test_a_memdev_missing_is_named_before_anything_is_made(cli):
    with pytest.raises(cxl.CxlError, match=r"region r0: no memdev with serial 0x2000"):
        cxl.bring_up({"pmem": False, "regions": [{**RAM, "serials": [0x2000]}]})
    assert cli.calls == [("cxl", "list", "-M")]
