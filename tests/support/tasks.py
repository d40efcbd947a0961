"""A one-file task folder with an oracle solution."""

from __future__ import annotations

from pathlib import Path

from t1async.commands.synth import TaskFiles, write_task


def note_task(root: Path, name: str, solution: str = "cat note.txt\necho done > out.txt\n") -> Path:
    """A task whose oracle prints a file (a real observation) and then writes out.txt."""
    tests = '''
        from pathlib import Path

        def test_out_written():
            assert Path("/app/out.txt").read_text() == "done\\n"

        def test_note_kept():
            assert Path("/app/note.txt").read_text() == "pebble-42\\n"
    '''
    spec = TaskFiles("Print /app/note.txt, then write `done` to /app/out.txt.", {"note.txt": "pebble-42\n"}, tests,
                     solution)
    return write_task(root, name, "test", spec)
