"""eval/results.py: the committed records regenerate their tables byte for byte and their plots' data; every
table in docs/results/ is regenerable or marked as measured before records were kept; the links of the
results pages (and every other docs page) land on files and headings that exist."""

import json
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from script_helpers import load_script

from mhla_gen.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"


def load_results():
    if "eval_results" not in sys.modules:  # once: the tests share one module
        load_script(ROOT / "eval" / "results.py", "eval_results")
    return sys.modules["eval_results"]


def examples() -> list[str]:
    """The committed example records (small: the suite regenerates them)."""
    listed = json.loads((RESULTS / "records" / "manifest.json").read_text())["records"]
    return [e["name"] for e in listed if e.get("example")]


def test_committed_examples_regenerate_byte_for_byte(tmp_path):
    """Each example record, rendered from the record alone, gives the committed tables byte for byte and
    plots with the same bytes or (another matplotlib) the same data; ``regenerate --check`` agrees."""
    results = load_results()
    names = examples()
    assert names, "no example record in docs/results/records/manifest.json"
    for name in names:
        folder = RESULTS / "records" / name
        written = results.render(results.load(folder / "record.npz"), tmp_path / name)
        assert written and any(p.suffix == ".md" for p in written)
        for path in written:
            committed = folder / path.name
            if path.suffix == ".md":
                assert path.read_bytes() == committed.read_bytes(), f"{name}/{path.name} differs"
            else:
                assert results.same_output(path, committed) in ("same", "same data"), f"{name}/{path.name}"
    assert results.regenerate(check=True, names=names) == []


def test_every_committed_record_renders_its_committed_tables():
    """Not only the examples: every record of the manifest renders the tables and plots committed beside
    it, so a change to the rules or the reports that would change a committed reading fails here until
    the record is regenerated (``python eval/results.py regenerate``) and its page corrected."""
    results = load_results()
    listed = json.loads((RESULTS / "records" / "manifest.json").read_text())["records"]
    assert results.regenerate(check=True, names=[e["name"] for e in listed]) == []


def test_regenerate_writes_back_only_what_differs_and_only_listed_files(tmp_path):
    """A hand-edited table is reported by ``--check`` (nothing written) and restored by ``regenerate``; a
    plot whose data changed is reported; a file the manifest does not list is never touched."""
    results = load_results()
    records = tmp_path / "records"
    records.mkdir()
    name = examples()[0]
    shutil.copytree(RESULTS / "records" / name, records / name)
    entry = next(e for e in json.loads((RESULTS / "records" / "manifest.json").read_text())["records"]
                 if e["name"] == name)
    (records / "manifest.json").write_text(json.dumps({"records": [entry]}))
    table = next(records / name / f for f in entry["files"] if f.endswith(".md"))
    plot = next(records / name / f for f in entry["files"] if f.endswith(".png"))
    good_table, good_plot = table.read_bytes(), plot.read_bytes()
    table.write_text(table.read_text().replace("|", "||", 1))
    _rewrite_plot_data(plot, "[]")
    (records / name / "notes.md").write_text("a user's notes")
    assert sorted(results.regenerate(records, check=True)) == sorted(
        [f"{name}/{table.name}: differs", f"{name}/{plot.name}: differs"])
    assert table.read_bytes() != good_table  # --check writes nothing
    results.regenerate(records)
    committed_plot = RESULTS / "records" / name / plot.name
    assert table.read_bytes() == good_table and results.same_output(plot, committed_plot) != "differs"
    assert good_plot == plot.read_bytes() or results.png_data(plot) == results.png_data(committed_plot)
    assert (records / name / "notes.md").read_text() == "a user's notes"
    entry["files"].append("missing.md")
    (records / "manifest.json").write_text(json.dumps({"records": [entry]}))
    assert results.regenerate(records, check=True) == [
        f"{name}: renders {sorted(entry['files'][:-1])}, the manifest lists {sorted(entry['files'])}"]


def _rewrite_plot_data(path: Path, data: str) -> None:
    """``path``'s plot-data chunk replaced by ``data`` (the pixels kept)."""
    from PIL import Image, PngImagePlugin

    results = load_results()
    with Image.open(path) as image:
        image.load()
        info = PngImagePlugin.PngInfo()
        info.add_text(results.PLOT_KEY, data)
        image.save(path, pnginfo=info)


def test_record_round_trip_and_refusals(tmp_path):
    """A record saved and loaded keeps its meta, points, arrays and images exactly; a file that is no record
    is refused by name."""
    results = load_results()
    points = [{"arm": "mhla", "seed": 0, "step": 4, "grid": "smoke", "fid": 1.5, "commit": "abc1234"},
              {"arm": "mhla", "seed": 0, "step": 8, "grid": "smoke", "fid": float("nan")}]
    arrays = [{"val": np.arange(4, dtype=np.float32), "fid_draws": np.array([1.5, 1.4, 1.7]),
               "fid_samples": np.array(20), "symmetric": np.array([True, False])}, {}]
    meta = {"runner": "study", "version": results.RECORD_VERSION, "grids": ["smoke"]}
    record = results.Record(meta, points, arrays, {("smoke", "mhla"): np.zeros((3, 2, 2), np.uint8)})
    results.save(record, tmp_path / "record.npz")
    back = results.load(tmp_path / "record.npz")
    assert back.meta == record.meta and back.points[0] == points[0] and np.isnan(back.points[1]["fid"])
    assert set(back.arrays[0]) == set(arrays[0]) and back.arrays[1] == {}
    for key, value in arrays[0].items():
        assert back.arrays[0][key].dtype == value.dtype and np.array_equal(back.arrays[0][key], value)
    assert np.array_equal(back.images[("smoke", "mhla")], record.images[("smoke", "mhla")])
    samples = back.samples()
    assert samples.count(points[0]) == 20 and samples.fid_draws(points[0])[0] == 1.5
    assert list(samples.fid_draws(points[0])[1]) == [1.4, 1.7] and samples.arrays(points[1]) == {}
    np.savez(tmp_path / "other.npz", x=np.zeros(2))
    with pytest.raises(Exception, match="is not a study record"):
        results.load(tmp_path / "other.npz")
    with pytest.raises(FileNotFoundError, match="no record"):
        results.load(tmp_path / "none.npz")


def test_a_damaged_or_foreign_npz_is_refused_in_one_line(tmp_path):
    """A truncated record, a text file named .npz, a marked archive without meta and one whose arrays name
    a point it does not have: each a ``ConfigError`` naming the file (no zip, key or index error)."""
    results = load_results()
    record = results.Record({"runner": "study", "version": results.RECORD_VERSION},
                            [{"arm": "mhla", "seed": 0, "step": 4}], [{"val": np.arange(4.0)}])
    results.save(record, tmp_path / "record.npz")
    whole = (tmp_path / "record.npz").read_bytes()
    (tmp_path / "truncated.npz").write_bytes(whole[: len(whole) // 2])
    (tmp_path / "text.npz").write_text("hello")
    np.savez(tmp_path / "kind_only.npz", mhla_gen_kind=np.array(results.RECORD_KIND))
    meta = np.frombuffer(json.dumps({"version": results.RECORD_VERSION}).encode(), np.uint8)
    np.savez(tmp_path / "stray.npz", mhla_gen_kind=np.array(results.RECORD_KIND), meta=meta,
             points=np.frombuffer(b"[]", np.uint8), **{"p3.val": np.zeros(2)})
    for name in ("truncated", "text", "kind_only", "stray"):
        path = tmp_path / f"{name}.npz"
        with pytest.raises(ConfigError, match=re.escape(repr(str(path)))):
            results.load(path)


def test_add_refuses_a_record_no_runner_renders_and_leaves_the_name_free(tmp_path):
    """``add`` of a record whose runner renders nothing makes no folder (NAME stays free for the next try)."""
    results = load_results()
    run_folder = tmp_path / "run"
    record = results.Record({"runner": "no_such_runner", "version": results.RECORD_VERSION}, [], [])
    results.save(record, run_folder / "record.npz")
    with pytest.raises(ConfigError, match="'no_such_runner' is not a study runner"):
        results.add(run_folder, "mine", tmp_path / "records")
    assert not (tmp_path / "records" / "mine").exists()


def test_make_record_adds_provenance_and_refuses_what_no_runner_renders(tmp_path):
    """``make_record`` (what a runner with its own folder layout calls) stamps the command, date, torch and
    version, keeps one array dict per point, and refuses a runner that eval/ does not hold, or arrays that
    do not match the points."""
    results = load_results()
    points = [{"arm": "mhla", "seed": 0, "step": 4}]
    record = results.make_record("study", "python eval/study.py --smoke", points, [{"val": np.ones(3)}],
                                 {"grids": {"smoke": {"steps": 4}}})
    assert record.meta["runner"] == "study" and record.meta["version"] == results.RECORD_VERSION
    assert record.meta["command"] == "python eval/study.py --smoke" and record.meta["grids"]["smoke"]
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", record.meta["date"]) and record.meta["torch"]
    for runner in ("nosuch", "results", "../study", "Study"):
        with pytest.raises(Exception, match="is not a study runner"):
            results.make_record(runner, "x", points, [{}], {})
    with pytest.raises(ValueError, match="one dict per point"):
        results.make_record("study", "x", points, [], {})


def test_configs_name_each_arm_once_with_its_seeds_and_no_local_folder():
    """One entry per (grid, arm) with every seed; paths inside the checkout are relative to it."""
    results = load_results()
    from studies.experiments import Job

    config, grid, teacher = "/x/dit_digits.yaml", {"grid": "64"}, results.ROOT / "runs" / "t" / "final"
    jobs = [Job("mhla", seed, config, ["model.depth=2", f"model.init_from={teacher}"], [1, 2], "r", "s", 8,
                grid, stage1=["/elsewhere/x"]) for seed in (0, 1)]
    jobs.append(Job("softmax", 0, config, [], [2], "r", "s", 8, grid))
    assert results.configs(jobs) == [
        {"grid": "64", "arm": "mhla", "config": "dit_digits.yaml",
         "overrides": ["model.depth=2", "model.init_from=runs/t/final"], "stage1": ["/elsewhere/x"],
         "seeds": [0, 1]},
        {"grid": "64", "arm": "softmax", "config": "dit_digits.yaml", "overrides": [], "stage1": None,
         "seeds": [0]}]


def test_lossless_compaction_keeps_float64_that_float32_cannot_hold():
    results = load_results()
    exact = np.array([0.5, 0.25], dtype=np.float64)
    assert results._compact(exact).dtype == np.float32
    assert results._compact(np.array([0.1])).dtype == np.float64


def test_code_commit_names_this_checkout():
    results = load_results()
    assert re.fullmatch(r"[0-9a-f]{7}(\+changes)?|unknown", results.code_commit())


def test_commits_line_names_each_commit_and_its_arms():
    results = load_results()
    same = [{"arm": a, "seed": s, "commit": "abc1234"} for a in ("softmax", "mhla") for s in (0, 1)]
    assert results.commits_line(same) == "Code: commit `abc1234` for every point."
    mixed = same[:2] + [{"arm": "mhla", "seed": 0, "commit": "def5678"}, {"arm": "mhla", "seed": 1}]
    line = results.commits_line(mixed)
    assert "`abc1234`: softmax (seeds 0, 1)" in line and "`def5678`: mhla (seeds 0)" in line
    assert "`unknown`: mhla (seeds 1)" in line and "resumes" in line


# ------------------------------------------------------------------------------------------ the pages
def generated_files() -> set[Path]:
    listed = json.loads((RESULTS / "records" / "manifest.json").read_text())["records"]
    return {RESULTS / "records" / e["name"] / f for e in listed for f in e["files"]}


def test_every_table_in_docs_results_is_regenerable_or_marked():
    """A table is a file a committed record renders (the manifest lists it) or carries the mark
    'measured <date> at <commit>; no record kept' in its section
    or a section above it: a new table without a record fails here."""
    results = load_results()
    generated = generated_files()
    assert generated and all(p.is_file() for p in generated)
    pages = sorted(RESULTS.rglob("*.md"))
    assert len(pages) > 5
    quotable = results.quotable_tables(p.read_text() for p in generated if p.suffix == ".md")
    by_record = rendered_tables_by_record(generated)
    unmarked = {str(p.relative_to(ROOT)): results.unmarked_tables(p.read_text(), quotable,
                                                                  linked_tables(p, by_record))
                for p in pages if p not in generated}
    assert {page: lines for page, lines in unmarked.items() if lines} == {}
    marks = [m for p in pages for m in results.MARK.finditer(p.read_text())]
    assert marks and all(m.group(1) <= "2026-11-28" for m in marks)


def rendered_tables_by_record(generated):
    """Each committed record's name and the tables its rendered pages hold (each page read once)."""
    results, by_record = load_results(), {}
    for p in generated:
        if p.suffix == ".md":
            by_record.setdefault(p.parent.name, []).extend(results.quotable_tables([p.read_text()]))
    return by_record


def linked_tables(page, by_record):
    """The rendered tables of the committed records ``page`` links to (``records/NAME/...``)."""
    names = set(re.findall(r"records/([A-Za-z0-9_.-]+)/", page.read_text()))
    return [table for name in sorted(names) for table in by_record.get(name, [])]


def test_a_changed_number_in_a_quote_is_found_under_a_pages_mark():
    """A page's mark (its title section's) covers its old tables, not a changed quote of a record."""
    results = load_results()
    rendered = "# R\n\n| arm | x |\n|---|---|\n| a | 0.10 |\n"
    quotable = results.quotable_tables([rendered])
    page = ("# P\n\nmeasured 2026-11-27 at commit `abcdef1`; no record kept\n\n"
            "## New\n\n| arm | x |\n|---|---|\n")
    assert results.unmarked_tables(page + "| a | 0.10 |\n", quotable, quotable) == []
    assert results.unmarked_tables(page + "| a | 0.11 |\n", quotable, quotable) == [7]
    assert results.unmarked_tables(page + "| a | 0.11 |\n", quotable) == []  # a record it does not link


def test_an_unmarked_table_is_found():
    results = load_results()
    mark = "measured 2026-11-27 at commit `abcdef1`; no record kept"
    text = f"# Title\n\n## Old\n\n{mark}\n\n| a |\n|---|\n\n### Nested\n\n| b |\n\n## New\n\n| c |\n"
    assert results.unmarked_tables(text) == [16]
    assert results.unmarked_tables("# T\n\n```\n| in a code block |\n```\n") == []
    assert results.unmarked_tables(f"# T\n\n{mark.replace('`abcdef1`', '?')}\n\n| a |\n") == [5]
    unrecorded = "measured 2026-11-26 at an unrecorded commit (written up in `abcdef1`); no record kept"
    assert results.unmarked_tables(f"# T\n\n{unrecorded}\n\n| a |\n") == []


def test_a_quoted_table_needs_the_rendered_header_and_rows_unchanged():
    """A page may quote a table a committed record renders (its header and any of its rows, unchanged):
    a changed number, a row from elsewhere or another header is an unmarked table."""
    results = load_results()
    rendered = ("# R\n\n| arm | x |\n|---|---|\n| a | 0.10 |\n| b | 0.20 |\n\n"
                "| arm | y |\n|---|---|\n| a | 5 |\n")
    quotable = results.quotable_tables([rendered])
    assert results.tables(rendered) == [(3, ["| arm | x |", "|---|---|", "| a | 0.10 |", "| b | 0.20 |"]),
                                        (8, ["| arm | y |", "|---|---|", "| a | 5 |"])]
    page = "# P\n\ntext\n\n| arm | x |\n|---|---|\n| b | 0.20 |\n"
    assert results.unmarked_tables(page, quotable) == []
    assert results.unmarked_tables(page.replace("0.20", "0.21"), quotable) == [5]
    assert results.unmarked_tables(page.replace("| b | 0.20 |", "| a | 5 |"), quotable) == [5]
    assert results.unmarked_tables(page.replace("| arm | x |", "| arm | z |"), quotable) == [5]
    assert results.unmarked_tables(page) == [5]


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: code and emphasis marks and punctuation dropped (``_`` kept),
    spaces to hyphens."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        heading = re.match(r"#{1,6} (.*)", line)
        if heading and not fenced:
            base = slug(heading.group(1))
            found.add(base if base not in seen else f"{base}-{seen[base]}")
            seen[base] = seen.get(base, 0) + 1
    return found


REPO_URL = "https://github.com/mhla-gen/mhla_gen/blob/main/"


def links(path: Path):
    """``(target file, anchor)`` of every link in ``path`` into this repository (relative, or absolute
    to its main branch), outside code blocks."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(REPO_URL):
            file, _, anchor = target.removeprefix(REPO_URL).partition("#")
            yield ROOT / file, anchor
        elif not re.match(r"[a-z]+:", target):
            file, _, anchor = target.partition("#")
            yield (path.parent / file).resolve() if file else path, anchor


def test_docs_links_land_on_files_and_headings():
    """Every link of README.md and docs/ into the repository names a file that exists and, with an
    anchor, a heading of that file (moved results sections keep their links working)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target, anchor in links(page):
            if not target.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target):
                broken.append(f"{page.relative_to(ROOT)}: {target.relative_to(ROOT)}#{anchor}")
    assert broken == []


def test_slug_is_githubs():
    assert slug("The softmax / linear / MHLA study") == "the-softmax--linear--mhla-study"
    assert slug("`fid.py`") == "fidpy"
    assert slug("Models (`benchmarks/bench_models.py`)") == "models-benchmarksbench_modelspy"
    assert slug("On one H200, bf16 (2026-11-27)") == "on-one-h200-bf16-2026-11-27"


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def cell_count(row: str) -> int:
    """The cells of a Markdown table row; a ``|`` inside inline code or escaped is no separator."""
    row = re.sub(r"`[^`]*`", "x", row.strip()).replace("\\|", "x")
    return len(row.strip("|").split("|"))


def ragged_rows(text: str) -> list[int]:
    """Line numbers of table rows whose cell count differs from their table's header (a stray line pasted
    onto a table renders as a broken row)."""
    results = load_results()
    return [start + i for start, lines in results.tables(text) for i, row in enumerate(lines)
            if cell_count(row) != cell_count(lines[0])]


def test_docs_tables_have_as_many_cells_per_row_as_their_header():
    broken = {str(p.relative_to(ROOT)): rows for p in doc_pages() if (rows := ragged_rows(p.read_text()))}
    assert broken == {}


def test_a_ragged_row_is_found():
    table = "| a | `x | y` | b |\n|---|---|---|\n| 1 | 2 \\| 3 | 4 |\n"
    assert ragged_rows(table) == []
    assert ragged_rows(table + "| comparison | step |\n") == [4]


# The project speaks of itself (dates, commits, commands), never of how its work was organised.
OFF_PROJECT = re.compile(r"\b(sessions?|agents?|assistants?|rounds? [0-9]+)\b", re.IGNORECASE)


def test_docs_speak_of_the_project_only():
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:80]}" for p in doc_pages()
             for n, line in enumerate(p.read_text().splitlines(), 1) if OFF_PROJECT.search(line)]
    assert found == []
