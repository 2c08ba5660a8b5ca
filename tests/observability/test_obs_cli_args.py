"""Argument handling of `pdengine probe pins` and `pdengine bench` (no server needed)."""

from __future__ import annotations

import pytest

from pdengine.server import bench_cli, probe
from pdengine.server.diagnostics_scrape import is_loopback


@pytest.mark.parametrize("url", ["http://10.1.2.3:8000", "https://example.com", "192.168.0.9:80"])
def test_bench_refuses_remote_targets_unless_asked(url, capsys) -> None:
    assert bench_cli.main(["abort-storm", "--url", url]) == 2
    assert "--allow-remote" in capsys.readouterr().err


def test_bench_corruption_checks_the_reference_url_too(capsys) -> None:
    argv = ["corruption", "--url", "http://127.0.0.1:9", "--reference-url", "http://10.0.0.8:80"]
    assert bench_cli.main(argv) == 2
    assert "10.0.0.8" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["abort-storm", "--requests", "0"],
        ["abort-storm", "--requests", "100000"],
        ["abort-storm", "--rounds", "-1"],
        ["abort-storm", "--drain-timeout", "9999"],
        ["corruption", "--requests", "lots"],
    ],
)
def test_bench_counts_and_times_are_bounded(argv) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_cli.main(argv)
    assert exc.value.code == 2


def test_unreachable_targets_exit_2_with_a_message(capsys) -> None:
    # port 9 (discard) on loopback: nothing listens there in the test environment
    assert bench_cli.main(["abort-storm", "--url", "http://127.0.0.1:9", "--no-progress"]) == 2
    assert "cannot reach" in capsys.readouterr().err
    assert probe.main(["pins", "--url", "127.0.0.1:9", "--samples", "2", "--interval", "0.1"]) == 2
    assert "cannot reach" in capsys.readouterr().err


def test_probe_window_is_bounded(capsys) -> None:
    assert probe.main(["pins", "--samples", "1"]) == 2
    assert probe.main(["pins", "--interval", "0"]) == 2
    assert "--samples" in capsys.readouterr().err


def test_loopback_hosts() -> None:
    assert is_loopback("http://127.0.0.1:8000") and is_loopback("http://localhost")
    assert is_loopback("http://[::1]:8000")
    assert not is_loopback("http://127.0.0.2.example.com:80")
