"""docs/state-machines.md is generated from the tables and must not go stale."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pdengine.fsm.request import REQUEST_MACHINE
from pdengine.fsm.room import ROOM_MACHINE

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "tools" / "gen_docs.py"


def test_state_machine_doc_is_current():
    proc = subprocess.run([sys.executable, str(GEN), "--check"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_doc_shows_every_transition_of_both_tables():
    text = (ROOT / "docs" / "state-machines.md").read_text()
    assert text.count("stateDiagram-v2") == 2
    for machine in (ROOM_MACHINE, REQUEST_MACHINE):
        for src, trigger, dst in machine.rows():
            line = next(ln for ln in text.splitlines() if ln.strip().startswith(f"{src.name} --> {dst.name}:"))
            assert trigger in line


def test_check_fails_on_a_stale_file(tmp_path, monkeypatch):
    sys.path.insert(0, str(GEN.parent))
    try:
        import gen_docs
    finally:
        sys.path.remove(str(GEN.parent))
    stale = tmp_path / "state-machines.md"
    stale.write_text(gen_docs.render().replace("chunk_done", "chunk_finished"))
    monkeypatch.setattr(gen_docs, "TARGET", stale)
    monkeypatch.setattr(gen_docs, "ROOT", tmp_path)
    assert gen_docs.main(["--check"]) == 1
    assert gen_docs.main([]) == 0
    assert gen_docs.main(["--check"]) == 0
