"""The README and docs/: short README with the two commands, every page reachable, every link
resolving inside the repository, the generated configuration page current, every metric the learner
writes to metrics.jsonl documented in docs/run-directory.md (and nothing documented that the code
no longer writes)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import REPO

ROOT = REPO
README = ROOT / "README.md"
SETUP_AND_RUN = "bash tools/setup.sh && .venv/bin/t1async launch configs/local.yaml"
SETUP_AND_TEST = "bash tools/setup.sh && .venv/bin/python -m pytest -q"
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")

GEN_CONFIG_DOCS = ROOT / "tools" / "gen_config_docs.py"


def generated_config_page(root: Path) -> str:
    """The page ``python tools/gen_config_docs.py --root ROOT`` writes for the config sources under ``root``."""
    out = root / "generated-configuration.md"
    run = subprocess.run([sys.executable, str(GEN_CONFIG_DOCS), "--root", str(root), "--out", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return out.read_text()


def pages() -> list[Path]:
    return sorted((ROOT / "docs").rglob("*.md"))


def links(page: Path) -> list[str]:
    """Targets of the Markdown links and images of ``page``, code blocks and spans left out."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


def local_target(page: Path, target: str) -> Path | None:
    """The file a relative link of ``page`` points at; None for a web address or an anchor."""
    if re.match(r"^[a-z]+:", target) or target.startswith("#"):
        return None
    return (page.parent / target.split("#")[0]).resolve()


def test_readme_is_short_and_holds_the_two_commands_ci_runs():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert SETUP_AND_RUN in text and SETUP_AND_TEST in text
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == SETUP_AND_TEST  # the README's test command, exactly, is what CI runs last


def test_every_docs_page_is_reachable_from_the_readme():
    seen, todo = {README.resolve()}, [README]
    while todo:
        page = todo.pop()
        for target in links(page):
            path = local_target(page, target)
            if path and path.suffix == ".md" and path.is_file() and path not in seen:
                seen.add(path)
                todo.append(path)
    unreachable = [p.relative_to(ROOT).as_posix() for p in pages() if p.resolve() not in seen]
    assert not unreachable, f"docs pages no link from README.md leads to: {unreachable}"


@pytest.mark.parametrize("page", [README, *pages()], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_link_resolves_inside_the_repository(page):
    bad = []
    for target in links(page):
        path = local_target(page, target)
        if path is None:
            continue
        if ROOT.resolve() not in path.parents or not path.exists():
            bad.append(target)
    assert not bad, f"{page.relative_to(ROOT)}: links outside the repository or to nothing: {bad}"
    text = page.read_text()
    for outside in ("../shared", "/work/shared", "DESIGN.md"):
        assert outside not in text, f"{page.relative_to(ROOT)} names {outside!r}, which is not in this repository"


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of ``page``'s headings: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces as ``-``."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    headings = re.findall(r"^#+ (.+)$", text, flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", [README, *pages()], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_anchor_a_link_names_exists(page):
    bad = []
    for target in links(page):
        if "#" not in target or re.match(r"^[a-z]+:", target):
            continue
        path, anchor = target.split("#", 1)
        dest = (page.parent / path).resolve() if path else page
        if dest.suffix == ".md" and dest.is_file() and anchor not in anchors(dest):
            bad.append(target)
    assert not bad, f"{page.relative_to(ROOT)}: links to headings that do not exist: {bad}"


def test_configuration_page_is_generated_from_the_config_and_current():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_config_docs.py"), "--check"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr + "\nrun: python tools/gen_config_docs.py"


def test_config_docs_generator_reads_a_config_package_with_enums_and_sees_a_stale_page(tmp_path):
    pkg = tmp_path / "t1async" / "config"
    pkg.mkdir(parents=True)
    (pkg / "choices.py").write_text('''
import enum

class Advantage(str, enum.Enum):
    """How advantages are estimated."""
    GAE = "gae"
    """The critic's GAE."""
    GROUP = "group"
''')
    (pkg / "__init__.py").write_text('''
from dataclasses import dataclass, field
from .choices import Advantage

@dataclass
class InnerConfig:
    """An inner section."""
    depth: int = 3
    """How deep."""

@dataclass
class LearnerConfig:
    """The learner."""
    lr: float = 1e-4
    """Learning rate."""
    advantage: Advantage = Advantage.GROUP
    """Estimator."""
    inner: InnerConfig = field(default_factory=InnerConfig)
    names: list[str] = field(default_factory=list)
    """Some ``names``."""

@dataclass
class Config:
    learner: LearnerConfig = field(default_factory=LearnerConfig)
''')
    page = generated_config_page(tmp_path)
    assert "## learner\n" in page and "## learner.inner\n" in page
    assert "- `learner.lr` (`float`, default `1e-4`): Learning rate." in page
    assert "- `learner.advantage` (`Advantage`, default `group`): Estimator." in page
    assert "Values (`Advantage`): `gae` (The critic's GAE.), `group`." in page
    assert "- `learner.names` (`list[str]`, default `[]`): Some `names`." in page
    assert "- `learner.inner.depth` (`int`, default `3`): How deep." in page
    out = tmp_path / "configuration.md"
    out.write_text(page)
    tool = [sys.executable, str(ROOT / "tools" / "gen_config_docs.py"),
            "--root", str(tmp_path), "--out", str(out), "--check"]
    assert subprocess.run(tool, capture_output=True).returncode == 0
    out.write_text(page.replace("How deep.", "How shallow."))
    stale = subprocess.run(tool, capture_output=True, text=True)
    assert stale.returncode == 1 and "stale" in stale.stderr



def test_config_docs_list_the_values_of_a_choice_and_the_rule_of_a_field(tmp_path):
    """A config choice is a subclass of an Enum subclass (``class Reward(Choice)``); its values are
    listed, and a field's rule text (``field(metadata=rule(...))``) is shown beside it."""
    pkg = tmp_path / "t1async" / "config"
    pkg.mkdir(parents=True)
    (pkg / "rules.py").write_text('''
import enum

class Choice(str, enum.Enum):
    """Base of the choices."""
    __str__ = str.__str__
''')
    (pkg / "__init__.py").write_text('''
from dataclasses import dataclass, field
from .rules import Choice, choice, rule

class Reward(Choice):
    """Episode reward."""
    dense = "dense"
    """Tests passed"""
    binary = "binary"

_ONE_UP = rule(lambda v: v >= 1, "an integer >= 1")

@dataclass
class LearnerConfig:
    reward: Reward = field(default=Reward.binary, metadata=choice(Reward, "'dense' or 'binary'"))
    """The reward."""
    steps: int = field(default=3, metadata=rule(lambda v: v >= 0, "an integer >= 0 (0: ``forever``)"))
    """Steps."""
    batch: int = field(default=2, metadata=_ONE_UP)
    """Batch."""

@dataclass
class Config:
    learner: LearnerConfig = field(default_factory=LearnerConfig)
''')
    page = generated_config_page(tmp_path)
    assert "- `learner.reward` (`Reward`, default `binary`): The reward.\n" \
           "  Values (`Reward`): `dense` (Tests passed), `binary`." in page
    assert "- `learner.steps` (`int`, default `3`): Steps.\n  Valid: an integer >= 0 (0: `forever`)." in page
    assert "- `learner.batch` (`int`, default `2`): Batch.\n  Valid: an integer >= 1." in page


def test_the_configuration_page_lists_the_values_of_each_choice():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert "- `learner.reward` (`Reward`, default `dense`)" in page
    assert "  Values (`Reward`): `dense` (The number of verifier tests passed), `binary` (1 when resolved, else 0)." in page
    assert "  Values (`SandboxName`): `local` " in page and "  Valid: an integer >= 1 (episodes per drawn task)." in page


# ------------------------------------------------------------------ metrics.jsonl keys

# Keys only the learner's metrics rows hold: a dict literal with one of them is a metrics row (or
# part of one). Kept narrow so that status, soak and mismatch outputs (which share some names) stay out.
ANCHORS = {"trajectories_total", "policy_loss", "is_weight_mean", "versions_in_batch", "explained_variance"}
# What the collector must find, so that a refactor that hides the metrics from it fails here
# instead of passing with nothing checked.
MUST_FIND = {"step", "version", "reward_mean", "policy_loss", "value_loss", "kl_k3", "routing_diff_frac",
             "drift_tokens", "step_s", "batch_wait_s", "tokens_per_s", "time"}


def product_files() -> list[Path]:
    files = sorted((ROOT / "t1async").rglob("*.py"))
    return [p for p in files if "tasks" not in p.parts]  # t1async/envs/tasks: the tasks' own tests


def _dict_keys(node: ast.AST) -> set[str]:
    """String keys of a dict literal (with ``**{...}`` merges and ``a if c else b`` branches) or of ``dict(k=...)``."""
    if isinstance(node, ast.Dict):
        keys = set()
        for k, v in zip(node.keys, node.values):
            if k is None:
                keys |= _dict_keys(v)
            elif isinstance(k, ast.Constant) and isinstance(k.value, str):
                keys.add(k.value)
        return keys
    if isinstance(node, ast.IfExp):
        return _dict_keys(node.body) | _dict_keys(node.orelse)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
        return {kw.arg for kw in node.keywords if kw.arg}
    return set()


def _str(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def learner_metric_keys() -> dict[str, str]:
    """Every key of the rows the learner appends to metrics.jsonl, read from the source: the keys of
    dict literals holding an anchor key, and per function the keys stored into (``m["k"] = ...``) a
    variable named ``*metrics*`` or bound to such a literal; less the keys popped from them
    (``metrics.pop("trained_tokens")``: an intermediate). Returns key -> where it was found."""
    found: dict[str, str] = {}
    popped: set[str] = set()
    for path in product_files():
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            where = f"{path.relative_to(ROOT).as_posix()}:{fn.name}"
            names = {a.arg for a in fn.args.args if "metrics" in a.arg}
            for node in ast.walk(fn):
                keys = _dict_keys(node) if isinstance(node, (ast.Dict, ast.Call)) else set()
                if keys & ANCHORS:
                    for k in keys:
                        found.setdefault(k, where)
                if isinstance(node, ast.Assign):
                    for t in node.targets:
                        if isinstance(t, ast.Name) and ("metrics" in t.id or _dict_keys(node.value) & ANCHORS):
                            names.add(t.id)
            for node in ast.walk(fn):
                if isinstance(node, (ast.Assign, ast.AugAssign)):
                    for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                        for s in t.elts if isinstance(t, ast.Tuple) else [t]:
                            if isinstance(s, ast.Subscript) and isinstance(s.value, ast.Name) and s.value.id in names \
                                    and _str(s.slice):
                                found.setdefault(_str(s.slice), where)
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "pop" \
                        and isinstance(node.func.value, ast.Name) and node.func.value.id in names and node.args \
                        and _str(node.args[0]):
                    popped.add(_str(node.args[0]))
    return {k: v for k, v in found.items() if k not in popped}


def documented_metrics() -> set[str]:
    """First-column keys of the tables under docs/run-directory.md's "metrics.jsonl" heading."""
    text = (ROOT / "docs" / "run-directory.md").read_text()
    section = re.search(r"^## metrics\.jsonl.*?(?=^## |\Z)", text, flags=re.S | re.M)
    assert section, "docs/run-directory.md has no '## metrics.jsonl' section"
    return {k for row in re.findall(r"^\|\s*([^|]+?)\s*\|", section.group(0), flags=re.M)
            for k in re.findall(r"`([a-z_][a-z0-9_]*)`", row)}


def test_every_metric_the_learner_writes_is_documented():
    written = learner_metric_keys()
    assert MUST_FIND <= set(written), f"the collector lost track of the learner's metrics: {MUST_FIND - set(written)}"
    missing = {k: v for k, v in written.items() if k not in documented_metrics()}
    assert not missing, f"metrics.jsonl keys not in docs/run-directory.md (key: where it is written): {missing}"


def test_every_documented_metric_is_written_somewhere():
    source = "\n".join(p.read_text() for p in product_files())
    gone = sorted(k for k in documented_metrics() if f'"{k}"' not in source and f"'{k}'" not in source)
    assert not gone, f"docs/run-directory.md documents metrics no product code names: {gone}"


def test_no_product_file_or_tool_points_outside_the_repository():
    """Docstrings and comments name docs/ pages, never a design guide or a folder outside the repo."""
    files = [*product_files(), *sorted((ROOT / "tools").glob("*.py"))]
    bad = [f"{p.relative_to(ROOT)}: {needle}" for p in files for needle in ("DESIGN.md", "../shared", "/work/shared")
           if needle in p.read_text()]
    assert not bad, f"pointers to files outside the repository: {bad}"
