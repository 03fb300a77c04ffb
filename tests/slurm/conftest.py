"""One real single-node Slurm per test session (`launcher.cluster.up` in a temporary state directory).

Skipped only where the machine cannot run it: not root, or Slurm/munge missing and no apt-get to install them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from launcher.cluster import cannot_start_reason, cluster_env, down, up


def pytest_configure(config):
    config.addinivalue_line("markers", "slurm: runs jobs on a real single-node Slurm started by `osprey cluster up`")


@pytest.fixture(scope="session")
def slurm_cluster():
    """The running cluster's environment (SLURM_CONF set, also in os.environ for the session); stopped at the end."""
    reason = cannot_start_reason()
    if reason:
        pytest.skip(reason)
    # A short path, not pytest's tmp_path: munge's socket path must fit in a unix socket address (108 bytes).
    state_dir = Path(tempfile.mkdtemp(prefix="osprey-slurm-"))
    previous = os.environ.get("SLURM_CONF")
    try:
        up(state_dir, timeout=60)
        os.environ["SLURM_CONF"] = str(state_dir / "slurm.conf")
        yield {"state_dir": state_dir, "env": cluster_env(state_dir)}
    finally:
        down(state_dir)
        shutil.rmtree(state_dir, ignore_errors=True)
        if previous is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = previous
