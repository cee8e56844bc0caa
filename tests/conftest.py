"""Shared test configuration: every test under tests/vm/ is a VM test."""

import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "/tests/vm/" in str(item.fspath):
            item.add_marker(pytest.mark.vm)
