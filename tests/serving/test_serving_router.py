"""Router pair selection (round robin, least loaded, health) on a real RouterBackend."""

from __future__ import annotations

import pytest

from pdengine.model import Tokenizer, resolve_model
from pdengine.server.router import RouterBackend
from pdengine.types import InvalidRequestError


def router(policy: str) -> RouterBackend:
    return RouterBackend(["http://p0", "http://p1"], ["http://d0", "http://d1"],
                         model_name="tiny", tokenizer=Tokenizer.load(resolve_model("tiny")),
                         max_model_len=4096, policy=policy)


def urls(pair: tuple) -> tuple[str, str]:
    return pair[0].url, pair[1].url


def test_round_robin_visits_every_pair_and_skips_unhealthy() -> None:
    r = router("round_robin")
    seen = [urls(r.pick_pair(set())) for _ in range(4)]
    assert sorted(seen) == sorted((p, d) for p in ("http://p0", "http://p1")
                                  for d in ("http://d0", "http://d1"))
    r.prefill[0].healthy = False
    assert {urls(r.pick_pair(set()))[0] for _ in range(4)} == {"http://p1"}


def test_least_loaded_and_retry_avoids_the_failed_pair() -> None:
    r = router("least_loaded")
    r.prefill[0].in_flight, r.decode[0].in_flight = 5, 3
    assert urls(r.pick_pair(set())) == ("http://p1", "http://d1")
    assert urls(r.pick_pair({("http://p1", "http://d1")})) != ("http://p1", "http://d1")


def test_policy_and_worker_lists_are_checked() -> None:
    with pytest.raises(InvalidRequestError, match="policy"):
        router("random")
    with pytest.raises(ValueError, match="at least one"):
        RouterBackend([], ["http://d0"], model_name="tiny", tokenizer=None, max_model_len=1)
