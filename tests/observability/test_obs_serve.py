"""Observability against one real `pdengine serve --trace-file F` (three processes, NIXL).

One deployment for the whole module: a traced request, the probe (idle, healthy under load),
a small abort storm and the corruption check.
"""

from __future__ import annotations

import json
from itertools import pairwise

import httpx
import pytest
from obs_serve_helpers import BackgroundLoad, read_spans, running_serve, wait_for

from pdengine.server import bench_cli, probe

pytestmark = pytest.mark.timeout(240)
EXPECTED_NAMES = {"text_completion tiny", "prefill request", "decode request", "room prefill",
                  "room decode"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("obs-serve")
    trace_file = workdir / "trace.jsonl"
    with running_serve(workdir, "--trace-file", str(trace_file)) as s:
        s.trace_file = trace_file
        yield s


def _tree_of_one_request(served) -> tuple[dict, list[dict]]:
    prompt = [97 + i % 26 for i in range(600)]  # several prefill chunks
    resp = httpx.post(
        f"{served.url}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0.0,
              "ignore_eos": True},
        timeout=60.0,
    )
    assert resp.status_code == 200, resp.text

    def complete():
        spans = read_spans(served.trace_file)
        roots = [s for s in spans if s["name"] == "text_completion tiny" and not s["parent_id"]]
        if not roots:
            return None
        tid = roots[-1]["trace_id"]
        mine = [s for s in spans if s["trace_id"] == tid]
        # each process writes its spans as they end: wait for the last of them
        return (roots[-1], mine) if {s["name"] for s in mine} >= EXPECTED_NAMES else None

    return wait_for(complete, 15.0, f"the request's spans in the trace file\n{served.log_tail()}")


def _transitions(span: dict) -> list[tuple[str, str, str]]:
    return [
        (e["attributes"]["trigger"], e["attributes"]["from"], e["attributes"]["to"])
        for e in span["events"]
        if e["name"] == "transition"
    ]


def test_one_request_is_one_trace_across_three_processes(served) -> None:
    root, spans = _tree_of_one_request(served)
    assert {s["service"] for s in spans} == {"pdengine-router", "pdengine-prefill",
                                             "pdengine-decode"}
    assert len({s["pid"] for s in spans}) == 3
    attrs = root["attributes"]
    assert attrs["gen_ai.operation.name"] == "text_completion"
    assert attrs["gen_ai.request.model"] == "tiny"
    assert attrs["gen_ai.request.max_tokens"] == 4
    assert attrs["gen_ai.usage.input_tokens"] == 600
    assert attrs["gen_ai.usage.output_tokens"] == 4

    by_id = {s["span_id"]: s for s in spans}
    for role in ("prefill", "decode"):
        (room,) = [s for s in spans if s["name"] == f"room {role}"]
        request = by_id[room["parent_id"]]
        assert request["name"] == f"{role} request"
        assert request["service"] == f"pdengine-{role}"
        assert request["parent_id"] == root["span_id"]
        assert room["attributes"]["pdengine.room.final_state"] == "SUCCESS"
        steps = _transitions(room)
        assert steps[0][1] == "BOOTSTRAPPING"
        assert steps[-1] == ("succeed", "TRANSFERRING", "SUCCESS")
        for (_, _, to), (_, frm, _) in pairwise(steps):
            assert frm == to  # each transition starts where the previous one ended
        times = [e["time_ns"] for e in room["events"]]
        assert times == sorted(times)
        assert root["start_ns"] <= room["start_ns"] <= room["end_ns"] <= root["end_ns"]
    decode_room = next(s for s in spans if s["name"] == "room decode")
    assert decode_room["attributes"]["pdengine.room.checksum"] == "verified"


def test_probe_says_idle_when_nothing_runs(served, capsys) -> None:
    rc = probe.main(["pins", "--url", served.url, "--samples", "3", "--interval", "0.2", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert (rc, out["verdict"]) == (0, "idle"), out
    assert len(out["samples"]) == 3
    # a worker's own URL works too (no router in front)
    workers = httpx.get(f"{served.url}/debug/workers", timeout=5.0).json()["workers"]
    decode_url = next(w["url"] for w in workers if w["role"] == "decode")
    rc = probe.main(["pins", "--url", decode_url, "--samples", "2", "--interval", "0.1"])
    assert rc == 0 and "verdict: idle" in capsys.readouterr().out


def test_probe_says_healthy_under_live_load(served, capsys) -> None:
    with BackgroundLoad(served.url, clients=3) as load:
        wait_for(lambda: load.streamed >= 3, 60.0, "tokens of the loaded requests")
        rc = probe.main(
            ["pins", "--url", served.url, "--samples", "6", "--interval", "0.3", "--json"]
        )
    out = json.loads(capsys.readouterr().out)
    assert (rc, out["verdict"]) == (0, "healthy"), out
    assert any(s["running"] > 0 for s in out["samples"])
    assert not load.errors


def test_small_abort_storm_leaves_no_pin_and_no_leak(served, capsys) -> None:
    rc = bench_cli.main(
        ["abort-storm", "--url", served.url, "--requests", "10", "--rounds", "1",
         "--prompt-tokens", "400", "--max-tokens", "12", "--json", "--no-progress"]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out
    assert (out["pins"], out["leaked_pages"]) == (0, 0)
    assert out["rounds"] == 1 and out["requests"] == 10
    assert out["aborted"] + out["completed"] + out["errors"] == 10
    assert out["aborted"] >= 1 and out["errors"] == 0, out
    assert 0.0 <= out["drain_seconds_max"] < 30.0


def test_corruption_check_matches_the_colocated_engine(served, capsys) -> None:
    rc = bench_cli.main(
        ["corruption", "--url", served.url, "--requests", "3", "--max-prompt-tokens", "600",
         "--max-tokens", "6", "--json"]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out
    assert (out["compared"], out["mismatches"], out["checksum_failures"]) == (3, 0, 0)
    assert "colocated" in out["reference"]
