"""Fuzz the public API from its own OpenAPI schema (GET /openapi.json) with schemathesis:
valid and invalid requests for every operation, a bounded number of examples each.

Against a real colocated server (`pdengine serve --colocated`) and, with fewer examples, the
router of the shared PD deployment. Every answer must be < 500, the processes must still be
alive and healthy, and the deployment must end idle (nothing leaked by odd requests).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from rel_cluster import Cluster, Role, free_port, wait_for
from schemathesis import GenerationMode

pytestmark = pytest.mark.timeout(600)

SKIP = {"/health_generate"}  # one real generation per call, already covered; slow under fuzz


@pytest.fixture(scope="module")
def colocated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Role]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("PDENGINE_")}
    role = Role("serve", ["--colocated", "--model", "tiny", "--log-level", "warning",
                          "--max-concurrent-requests", "8"],
                env, tmp_path_factory.mktemp("fuzz"), port=free_port())
    role.start()
    try:
        role.wait_ready()
        yield role
    finally:
        role.stop()


def fuzz(base_url: str, examples: int) -> Counter[int]:
    """Run every operation of the server's schema, positive and negative; statuses seen."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    statuses: Counter[int] = Counter()
    server_errors: list[str] = []
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path in SKIP:
            continue
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case) -> None:
                response = case.call(base_url=base_url, timeout=60)
                statuses[response.status_code] += 1
                if response.status_code >= 500:
                    server_errors.append(f"{case.method} {case.path} {case.body!r}: "
                                         f"{response.status_code} {response.text[:300]}")

            try:
                run()
            except Unsatisfiable:  # nothing to make invalid (an operation without inputs)
                assert mode is GenerationMode.NEGATIVE, operation.label
    assert not server_errors, server_errors
    return statuses


def _healthy(url: str) -> bool:
    with httpx.Client(timeout=5.0, trust_env=False) as c:
        return c.get(f"{url}/health").status_code == 200


def test_fuzz_colocated_no_server_error(colocated: Role) -> None:
    statuses = fuzz(colocated.url, examples=12)
    assert statuses[200] > 0 and sum(v for k, v in statuses.items() if 400 <= k < 500) > 0
    assert colocated.alive and _healthy(colocated.url)

    def idle() -> bool:
        with httpx.Client(timeout=5.0, trust_env=False) as c:
            text = c.get(f"{colocated.url}/metrics").text
        lines = [ln for ln in text.splitlines() if ln.startswith(
            ("pdengine_num_running_reqs", "pdengine_num_queue_reqs", "pdengine_kv_pages_used"))]
        return bool(lines) and all(float(ln.rsplit(" ", 1)[1]) == 0 for ln in lines)

    wait_for(idle, 30.0, "the colocated server idle after the fuzz")


@pytest.mark.slow
def test_fuzz_router_no_server_error(pd: Cluster) -> None:
    statuses = fuzz(pd.url, examples=4)
    assert statuses[200] > 0
    assert all(r.alive for r in pd.roles) and _healthy(pd.url)
    pd.wait_idle(30.0)
