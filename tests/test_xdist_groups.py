"""`make test` runs `--dist loadgroup`: the tests of an `xdist_group` (tests/sharding/test_multihost_main.py,
tests/train/test_run_lifecycle.py, tests/sync/test_sync_worker.py) share session fixtures that start whole jobs, so
they must run on one worker. pytest-xdist names each test's group in its node id, which the scheduler reads; with
a pytest that ignores that (pytest 9.2 with pytest-xdist 3.8) the groups are spread over the workers and every
worker rebuilds their fixtures, silently: this test fails instead."""

import pytest


@pytest.mark.xdist_group("xdist_self_check")
def test_the_group_reaches_the_scheduler(request):
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not run with --dist loadgroup")
    assert request.node.nodeid.endswith("@xdist_self_check"), (
        f"{request.node.nodeid}: pytest {pytest.__version__} and the installed pytest-xdist do not work together "
        "(the group never reaches the scheduler); pin a pair that does in requirements-dev.txt")
