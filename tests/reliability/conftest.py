"""One PD deployment (three real processes, default deadlines) shared by the reliability
tests that leave it idle: the CI abort storm, bad input through the router, security."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from rel_cluster import Cluster, cluster


@pytest.fixture(scope="session")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tmp_path_factory.mktemp("pd"), worker_env={"PDENGINE_DEADLINES": ""}) as c:
        yield c
