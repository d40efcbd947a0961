import os
import stat
from pathlib import Path


def _mode(p):
    return stat.S_IMODE(os.stat(p).st_mode)


def _tree(root):
    dirs, files = [Path(root)], []
    for base, ds, fs in os.walk(root):
        dirs += [Path(base, d) for d in ds]
        files += [Path(base, f) for f in fs]
    return dirs, files


def test_secret_directories_700():
    dirs, _ = _tree("/app/secrets")
    assert len(dirs) == 3
    bad = {str(d): oct(_mode(d)) for d in dirs if _mode(d) != 0o700}
    assert not bad, bad


def test_secret_files_600():
    _, files = _tree("/app/secrets")
    assert len(files) == 4
    bad = {str(f): oct(_mode(f)) for f in files if _mode(f) != 0o600}
    assert not bad, bad


def test_public_directory_755():
    assert _mode("/app/public") == 0o755


def test_public_files_644():
    _, files = _tree("/app/public")
    assert len(files) == 2
    bad = {str(f): oct(_mode(f)) for f in files if _mode(f) != 0o644}
    assert not bad, bad
