"""The README is an entry a newcomer can follow: short, its commands, files and links exist,
its quick start is the script it names, and every docs/ page is linked from it."""

import os
import pathlib
import re
import sys

import pytest

import compiled_hooks
import passes
from tests.processes import run_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def test_readme_is_short_and_links_every_docs_page():
    assert len(README.encode()) <= 12_000
    linked = {m.group(1) for m in LINK.finditer(README)}
    assert DOCS, "no docs/ pages"
    missing = [
        p.relative_to(ROOT).as_posix() for p in DOCS if p.relative_to(ROOT).as_posix() not in linked
    ]
    assert not missing, f"docs pages the README does not link: {missing}"


@pytest.mark.parametrize(
    "page", [ROOT / "README.md", ROOT / "CHANGELOG.md", *DOCS], ids=lambda p: p.name
)
def test_relative_links_and_anchors_resolve(page):
    text = page.read_text()
    for match in LINK.finditer(text):
        target, anchor = match.groups()
        if "://" in target:
            continue
        path = (page.parent / target).resolve()
        assert path.exists(), f"{page.name}: link to {target} does not exist"
        if anchor and path.suffix == ".md":
            slugs = {
                re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                for h in re.findall(r"^#+ (.*)$", path.read_text(), flags=re.M)
            }
            assert anchor[1:] in slugs, (
                f"{page.name}: no heading for {target}{anchor} (have {sorted(slugs)})"
            )


def test_files_the_readme_commands_name_exist():
    commands = "\n".join(code_blocks(README, "bash"))
    named = re.findall(r"\b((?:examples|benchmarks|tests)/[\w/]+\.py)\b", commands + README)
    assert "examples/train_ddp.py" in named and "examples/quickstart.py" in named
    for path in named:
        assert (ROOT / path).exists(), path
    assert re.search(
        r"^pip install torch==2\.13\.0 -e \"\.\[test\]\" && python -m pytest -n 2$",
        commands,
        flags=re.M,
    )
    assert re.search(
        r"^pip install torch==2\.13\.0 -e \. && python examples/train_ddp\.py$",
        commands,
        flags=re.M,
    )


def test_quick_start_is_the_script_it_names():
    blocks = code_blocks(README.split("## Quick start", 1)[1], "python")
    assert blocks and blocks[0] == (ROOT / "examples" / "quickstart.py").read_text()


def test_version_is_one_value():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'version = "{compiled_hooks.__version__}"' in pyproject
    assert passes.__version__ == compiled_hooks.__version__
    for package in ("compiled_hooks", "passes"):
        assert (ROOT / package / "py.typed").exists()
    assert (ROOT / "LICENSE").read_text().startswith("BSD 3-Clause License")


def test_the_default_pipeline_row_lists_its_passes_in_order():
    from passes.pipeline import DEFAULT_PASSES

    row = next(
        line
        for line in (ROOT / "docs" / "passes.md").read_text().splitlines()
        if line.startswith("| `default_pipeline(")
    )
    listed = re.findall(r"`(\w+)`", row.split("|")[2])
    assert listed[: len(DEFAULT_PASSES)] == [p.__name__ for p in DEFAULT_PASSES]
    assert listed[len(DEFAULT_PASSES) :] == ["shard_weight_update"]


def test_no_dates_or_timing_tables_in_the_code():
    for package in ("compiled_hooks", "passes"):
        for path in (ROOT / package).rglob("*.py"):
            text = path.read_text()
            assert not re.search(r"20\d\d-\d\d-\d\d", text), f"{path.name} holds a date"
            assert not re.search(r"\d+(\.\d+)? ms\b", text), f"{path.name} holds a timing"


@pytest.mark.slow
def test_quick_start_runs_as_written():
    proc = run_script(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        timeout=300,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"^step \d+: loss ([\d.]+)$", proc.stdout, flags=re.M)]
    assert len(losses) == 4 and losses[-1] < losses[0] / 4, proc.stdout
    assert re.search(r"^final loss: [\d.]+ \(OK: ", proc.stdout, flags=re.M), proc.stdout
