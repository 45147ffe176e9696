import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    # `slow` tests first (a stable sort, file order otherwise): under pytest-xdist (`make test`
    # runs -n 2) the long multi-process runs start early and the many short tests fill the
    # gaps, instead of one long test starting last while the other worker idles.
    items.sort(key=lambda item: "slow" not in item.keywords)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_setup(item):
    # pytest 9.2 stopped pytest-xdist 3.8's loadgroup from seeing xdist_group marks
    # (pytest-xdist#1386): the grouped tests then spread over the workers, silently.
    # constraints-cpu.txt pins a pytest that works; fail loudly with one that does not.
    if (getattr(item.config.option, "loadgroup", False) and "@" not in item.nodeid
            and item.get_closest_marker("xdist_group")):
        pytest.fail("--dist loadgroup ignores xdist_group marks with this pytest and "
                    "pytest-xdist (pytest-xdist#1386): install the test extras through "
                    "constraints-cpu.txt (make install-test)", pytrace=False)
