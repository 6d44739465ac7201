"""The documentation states only figures that a committed results file holds, and no words
about how the project was built.

Convention for README.md, docs/*.md and benchmarks/README.md (docs/contributing.md explains it):

- A *figure* is a number with a unit: ``1.62x`` (a ratio: no space before the ``x``), ``14.45 ms``,
  ``us``, ``s``, ``mJ``, ``GiB``, ``MiB``, ``KiB``, ``%``, ``tokens/ms``, ``tokens/s``, ``TB/s``,
  ``GB/s``, ``TFLOP/s``, ``nats/byte``, ``bits/byte``; a ``k`` or ``M`` right after the number
  means thousands or millions (``105.1k tokens/s``). In a block that cites results, a bare decimal
  number (``0.7397``, ``2.3e-3``) is a figure too. Numbers in code spans, fenced code, headings,
  link targets and HTML comments are not figures, nor those of a block right below the line
  ``<!-- settings -->``: thresholds of the code stated in prose ("at most 0.6% of f").
- Every paragraph, list item or table row that states a figure links to the file it comes from:
  ``benchmarks/results/<file>`` (a ``.json``, ``.csv`` or ``.log``), relative to the page. A table
  row or a list item with no link of its own takes the links of the paragraph right above its
  table or list (its caption).
- Every *unit* of a cited block (a table row, or a sentence of prose) must be found in ONE record
  of the cited files, or in a PAIR of records of one list (dense and twell, or the two ends of a
  range). A record is any JSON object with numbers (nested objects and lists of numbers are
  flattened into it; lists of objects are records of their own; the timing rounds behind a
  median are left out); a ``.csv`` row is a record; a ``.log`` file is one record.
- A figure matches a number of the record when it equals that number rounded to the precision
  shown (``1.62x`` matches 1.6176 to 1.6249), after the unit's conversions (bytes to GiB, a share
  to %, s / ms / us, tokens/s to tokens/ms), and only from fields whose names fit the unit: a
  ratio ``Nx`` from a ``*speedup*`` field, ``ms`` from ``*_ms`` (or ``_us``, ``_s``) fields, GiB from
  ``*bytes*`` fields, and so on (``UNITS``). A ratio also matches ``a / b`` (either way round) of
  one time, throughput, size or energy field in two records that differ in one setting only
  (``variant`` dense and twell, ``kernels`` dense and sparse).
- A pair must share a quantity: a field that figures of the unit read from both records, or a
  ratio across them. So a row cannot take its dense time from one record and its twell time from
  an unrelated one.
- A table whose rows are mostly single records of the same files is a grid: every row must be one
  record, and every column must read one field in all its rows (a figure taken from the wrong
  column, or a typo that happens to equal another field of the record, breaks that).

The second test keeps build history out of the repository's text files: no issue numbers, no
work-period words or ordinals, no run tags of that kind. History lives in git.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import os
import re
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGES = ["README.md", "benchmarks/README.md"] + sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")
)

# unit -> (pattern of the field names it may come from, scale that turns the stored number into
# the unit shown); a text file's numbers have no names and take any scale of their unit
_MS, _US = r"(^|[_.])ms($|[_.\[])", r"(^|[_.])us($|[_.\[])"
_SEC = r"(wall|compile|run)_s($|[_.\[])"
_PER_S = r"(tok_s|per_s)($|[_.\[])"
UNITS = {
    "x": ((r"speedup|ratio|rel_to", 1.0),),
    "%": ((r"share|sparsity|frac|target|increase|density|rate", 100.0),),
    "ms": ((_MS, 1.0), (_SEC, 1e3), (_US, 1e-3)),
    "us": ((_US, 1.0), (_MS, 1e3)),
    "s": ((_SEC, 1.0), (_MS, 1e-3)),
    "mJ": ((r"mj", 1.0),),
    "GiB": ((r"bytes", 2.0**-30),),
    "MiB": ((r"bytes", 2.0**-20),),
    "KiB": ((r"bytes", 2.0**-10),),
    "tokens/ms": ((r"per_ms", 1.0), (_PER_S, 1e-3)),
    "tokens/s": ((_PER_S, 1.0), (r"per_ms", 1e3)),
    "TB/s": ((r"tbps", 1.0), (r"gbps", 1e-3)),
    "GB/s": ((r"gbps", 1.0), (r"tbps", 1e3)),
    "TFLOP/s": ((r"tflops", 1.0),),
    "nats/byte": ((r"loss", 1.0),),
    "bits/byte": ((r"bits_per_byte", 1.0),),
    "": ((r"", 1.0),),  # a bare decimal number in a cited block: any field
}
_NUM = r"(?<![\w.])(?P<sign>[-+]?)(?P<num>\d+(?:\.(?P<dec>\d+))?(?:e(?P<exp>[-+]?\d+))?)(?P<mult>[kM])?"
_UNIT_RE = "|".join(re.escape(u) for u in sorted((u for u in UNITS if u and u != "x"), key=len, reverse=True))
FIGURE = re.compile(
    _NUM + r"(?:(?P<ratio>x)(?![\w])|\s?(?P<unit>" + _UNIT_RE + r")(?![\w/])|(?P<bare>)(?![\w]|\.\d))"
)
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")
SETTINGS_MARK = "<!-- settings -->"  # on the line above a block whose figures are settings, not measurements


class Figure:
    """One figure as shown: its value, the tolerance its precision implies, its unit."""

    def __init__(self, text: str, value: float, tol: float, unit: str):
        self.text, self.value, self.tol, self.unit = text, value, tol, unit

    def __repr__(self) -> str:
        return self.text


def figures(text: str, bare: bool = True) -> list[Figure]:
    """The figures of ``text`` (code spans and link targets already removed); bare decimals only
    where ``bare``."""
    out = []
    matches = list(FIGURE.finditer(text))
    for i, m in enumerate(matches):
        unit = "x" if m.group("ratio") else (m.group("unit") or "")
        if m.group("bare") is not None:
            # "5.39 / 68.96 GiB", "87.8 and 99.8 tokens/ms": a bare number takes the unit of the
            # next one when only "/", ",", "and", "or" or "to" stand between them
            end = m.end()
            for n in matches[i + 1:]:
                if not re.fullmatch(r"\s*(?:/|,|and|or|to)\s*", text[end:n.start()]):
                    break
                if n.group("bare") is None:
                    unit = "x" if n.group("ratio") else n.group("unit")
                    break
                end = n.end()
        if not unit and (not bare or m.group("dec") is None):
            continue  # integers without a unit are settings (k 29, M 131072), not figures
        decimals = len(m.group("dec") or "")
        exp = int(m.group("exp") or 0)
        mult = {"k": 1e3, "M": 1e6}.get(m.group("mult") or "", 1.0)
        value = float(m.group("num")) * mult * (-1.0 if m.group("sign") == "-" else 1.0)
        tol = 0.5 * 10.0 ** (exp - decimals) * mult * (1 + 1e-9)
        out.append(Figure(m.group(0).strip(), value, tol, unit))
    return out


# ---------------------------------------------------------------------------------------------
# records


def _numbers(obj, prefix: str, out: dict) -> None:
    if isinstance(obj, bool) or obj is None:
        return
    if isinstance(obj, (int, float)):
        if math.isfinite(obj) and "_rounds[" not in prefix:  # the timing rounds behind a median: not figures
            out[prefix] = float(obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _numbers(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(obj, list) and not any(isinstance(v, dict) for v in obj):  # a list of records is not
        for i, v in enumerate(obj):                                               # part of its parent
            _numbers(v, f"{prefix}[{i}]", out)


class Record(dict):
    """A record's numbers by flattened key; ``group``: records of one list share it (they may be
    paired), the top-level object of a file has "top", any other record a group of its own;
    ``settings``: its own string and boolean fields (``variant``, ``kernels``, ``distribution``),
    apart from where and when it ran (``PROVENANCE``: two variants timed one after the other in
    one process carry two dates)."""

    group: object = None
    settings: dict = {}
    text = False  # numbers of a .log or .csv file: no field names


PROVENANCE = ("date", "gpu", "torch", "triton", "transformers")


def _records_of(obj, out: list, group) -> None:
    """Every object that holds numbers, flattened (its nested values included), depth first."""
    if isinstance(obj, dict):
        flat = Record()
        _numbers(obj, "", flat)
        if flat:
            flat.group = group
            flat.settings = {k: v for k, v in obj.items() if isinstance(v, (str, bool)) and k not in PROVENANCE}
            out.append(flat)
        for v in obj.values():
            _records_of(v, out, object())
    elif isinstance(obj, list):
        siblings = object()
        for v in obj:
            _records_of(v, out, siblings)


def _text_numbers(text: str) -> Record:
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)  # 235,153 -> 235153
    nums = re.findall(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?", text)
    rec = Record({f"n{i}": float(n) for i, n in enumerate(nums)})
    rec.text = True
    return rec


@lru_cache(maxsize=None)
def records(path: str) -> tuple:
    """The records of one results file (see the module's text)."""
    p = Path(path)
    if p.suffix == ".json":
        out: list = []
        _records_of(json.loads(p.read_text()), out, "top")
        return tuple(out)
    if p.suffix == ".csv":
        with open(p, newline="") as fh:
            rows = [_text_numbers(" ".join(v or "" for v in row.values())) for row in csv.DictReader(fh)]
        for r in rows:
            r.group = path
        return tuple(r for r in rows if r)
    rec = _text_numbers(p.read_text())
    rec.group = "top"
    return (rec,)


def pairable(a: Record, b: Record) -> bool:
    """Records of one list, or the top-level objects of two files, may make a pair."""
    return a.group is b.group or a.group == b.group == "top"


def _ratio_quantity(key: str) -> bool:
    """Whether a field is a time, a throughput, a size or an energy: a ratio across two variants
    of a run may be taken of it."""
    return re.search(r"(^|_)(ms|us|bytes|tok_s|per_s|per_ms|mj)($|_)", key.rpartition(".")[2]) is not None


@lru_cache(maxsize=None)
def _scales(unit: str, key) -> tuple:
    """The scales by which field ``key`` (None: any field) may show in ``unit``."""
    return tuple({s for pattern, s in UNITS[unit] if key is None or re.search(pattern, key.lower())})


def _close(fig: Figure, v: float, key: str = None) -> bool:
    """Whether the stored number ``v`` (of field ``key``; None: a ratio, or a text file's number)
    shows as ``fig``."""
    return any(abs(v * s - fig.value) <= fig.tol for s in _scales(fig.unit, key))


def _value_close(fig: Figure, rec: "Record", key: str) -> bool:
    if rec.text:
        scales = {s for _, s in UNITS[fig.unit]} | ({100.0, 1.0} if fig.unit == "%" else set())
        return any(abs(rec[key] * s - fig.value) <= fig.tol for s in scales)
    return _close(fig, rec[key], key)


def fields(fig: Figure, rec: Record) -> set:
    """The fields of ``rec`` that ``fig`` matches."""
    return {k for k in rec if _value_close(fig, rec, k)}


def variants(a: Record, b: Record) -> bool:
    """Two runs of one measurement: the same settings but one (``variant`` dense / twell,
    ``kernels`` dense / sparse)."""
    return a.settings.keys() == b.settings.keys() and sum(a.settings[k] != b.settings[k] for k in a.settings) == 1


def cross(fig: Figure, a: Record, b: Record) -> set:
    """The fields k with ``fig`` = a[k] / b[k] or b[k] / a[k], for two variants of one run."""
    if fig.unit != "x" or not variants(a, b):
        return set()
    return {k for k in a.keys() & b.keys() if _ratio_quantity(k)
            and any(y != 0 and _close(fig, x / y) for x, y in ((a[k], b[k]), (b[k], a[k])))}


def _fits(fig: Figure, recs: tuple) -> bool:
    return any(fields(fig, r) for r in recs) or (len(recs) == 2 and bool(cross(fig, *recs)))


def match(figs: list[Figure], recs: tuple):
    """How the figures of one unit are found in ``recs``: ``("single", fields)`` when one record
    holds them all (``fields``: for each figure, the fields it matches in any such record),
    ``("pair", None)`` when a pair does: two records of one list (or the top-level objects of
    two files) that share a quantity, a field which figures of the unit read from both or a ratio
    across them; None when neither does."""
    singles = [r for r in recs if all(fields(f, r) for f in figs)]
    if singles:
        return "single", [set().union(*(fields(f, r) for r in singles)) for f in figs]
    holders = [r for r in recs if any(fields(f, r) for f in figs)]
    for a, b in itertools.combinations(holders, 2):
        if not pairable(a, b):
            continue
        fa = [fields(f, a) for f in figs]
        fb = [fields(f, b) for f in figs]
        read = set().union(*fa, *fb)
        fx = [cross(f, a, b) & read if read else cross(f, a, b) for f in figs]  # a ratio of what the unit reads
        if not all(x or y or z for x, y, z in zip(fa, fb, fx)):
            continue
        if set().union(*fa) & set().union(*fb) or set().union(*fx):
            return "pair", None
    return None


def column_problems(rows: list) -> list[str]:
    """A table whose rows are each one record of the same files reads each column from one field:
    ``rows`` holds (line, positions), positions mapping (column, figure in the cell) to the fields
    the figure matches. A column whose rows share no field mixes quantities (a figure copied from
    the wrong column, or a typo that happens to equal another field)."""
    out = []
    columns: dict = {}
    for no, positions in rows:
        for pos, names in positions.items():
            columns.setdefault(pos, []).append((no, names))
    for (col, i), cells in columns.items():
        if len(cells) < 2 or set.intersection(*(names for _, names in cells)):
            continue
        counts: dict = {}
        for _, names in cells:
            for n in names:
                counts[n] = counts.get(n, 0) + 1
        best = max(counts, key=counts.get)
        odd = [str(no) for no, names in cells if best not in names]
        out.append(f"column {col + 1} reads {best!r} except on line(s) {', '.join(odd)}")
    return out


# ---------------------------------------------------------------------------------------------
# pages


class Block:
    """A paragraph, a list item, a table, a heading or the start of a fenced code block;
    ``settings``: marked as stating settings of the code, not measurements."""

    def __init__(self, kind: str, lines: list[tuple[int, str]], settings: bool = False):
        self.kind, self.lines, self.settings = kind, lines, settings

    @property
    def text(self) -> str:
        return " ".join(t for _, t in self.lines)


def blocks(markdown: str) -> list[Block]:
    """The blocks of a page with their line numbers: paragraphs, list items, tables (a row per
    line), headings and code blocks (their text dropped); HTML comments dropped."""
    out: list[Block] = []
    cur: list = []
    kind = ""
    fenced = comment = settings = False

    def close():
        nonlocal cur, settings
        if cur:
            out.append(Block(kind, cur, settings))
            settings = False
        cur = []

    for no, line in enumerate(markdown.splitlines(), 1):
        s = line.strip()
        if s.startswith("```"):
            close()
            if not fenced:
                out.append(Block("code", [(no, line)]))
            fenced = not fenced
            continue
        if fenced:
            continue
        if comment or s.startswith("<!--"):
            comment = "-->" not in s
            if s == SETTINGS_MARK:
                close()
                settings = True  # the next block states settings
            continue
        if not s:
            close()
            continue
        if s.startswith("#"):
            close()
            out.append(Block("heading", [(no, line)]))
            continue
        is_row = s.startswith("|")
        is_item = re.match(r"([-*+]|\d+\.)\s", s) is not None
        if is_row:
            if kind != "table":
                close()
            kind = "table"
        elif is_item:
            close()
            kind = "item"
        elif kind == "table" or not cur:
            close()
            kind = "paragraph"
        cur.append((no, line))
    close()
    return out


def _strip(text: str) -> str:
    text = re.sub(r"`[^`]*`", " ", text)
    return LINK.sub(lambda m: m.group(1), text)


def cited_files(text: str, page: Path) -> list[Path]:
    """The results files that ``text`` links to (relative to ``page``)."""
    out = []
    for _, target in LINK.findall(re.sub(r"`[^`]*`", " ", text)):
        path = (page.parent / target.split("#")[0]).resolve()
        if RESULTS in path.parents and path.suffix in (".json", ".csv", ".log"):
            out.append(path)
    return out


def units(block: Block) -> list[tuple[int, str, str]]:
    """(line, text, the text its own citations are read from) of each unit: a table row (which
    may cite its own file), or a sentence of prose (which takes its block's citations)."""
    if block.kind == "table":
        return [(no, t, t) for no, t in block.lines if not re.fullmatch(r"\s*\|[\s|:-]*\|?\s*", t)]
    text = _strip(block.text)
    return [(block.lines[0][0], s, block.text) for s in re.split(r"(?<=[.!?;])\s+(?=[A-Z(*])", text) if s.strip()]


def _cells(text: str) -> list[list[Figure]]:
    return [figures(_strip(c)) for c in text.strip().strip("|").split("|")]


def check_page(page: Path) -> list[str]:
    """Every problem of one page, as ``file:line: what``."""
    problems = []
    name = page.relative_to(ROOT)
    caption: list[Path] = []  # the links of the last paragraph, for the table or list right below it
    for block in blocks(page.read_text()):
        if block.kind in ("heading", "code") or block.settings:
            caption = []
            continue
        for path in cited_files(block.text, page):
            if not path.is_file():
                problems.append(f"{name}:{block.lines[0][0]}: cites {path.relative_to(ROOT)}, which does not exist")
        own = [p for p in cited_files(block.text, page) if p.is_file()]
        if block.kind == "paragraph":
            caption = own
        grid: list = []  # a table's rows found as single records: (line, links, positions)
        for no, text, cites in units(block):
            links = [p for p in cited_files(cites, page) if p.is_file()] if block.kind == "table" else own
            links = links or (caption if block.kind != "paragraph" else [])
            recs = tuple(r for p in links for r in records(str(p)))
            figs = figures(_strip(text), bare=bool(links))
            if not figs:
                continue
            if not links:
                problems.append(f"{name}:{no}: {figs} but no results file cited: {text.strip()[:90]}")
                continue
            found = match(figs, recs)
            if found is None:
                files = ", ".join(p.name for p in links)
                missing = [f for f in figs if not any(_fits(f, (r,)) for r in recs)]
                problems.append(f"{name}:{no}: {figs} not found together in one record (or a pair) of {files}"
                                + (f"; in none: {missing}" if missing else "") + f": {text.strip()[:90]}")
            elif block.kind == "table":
                kind, names = found
                spots = [(c, i) for c, cell in enumerate(_cells(text)) for i in range(len(cell))]
                positions = dict(zip(spots, names)) if kind == "single" and len(spots) == len(figs) else None
                grid.append((no, tuple(links), positions, text))
        problems += [f"{name}:{p}" for p in grid_problems(grid)]
    return problems


def grid_problems(grid: list) -> list[str]:
    """A table whose rows are mostly single records of the same files is a grid: each row one
    record, each column one field. A row of it that only a pair of records explains, or a column
    whose rows share no field, is reported."""
    out = []
    for links in {links for _, links, _, _ in grid}:
        rows = [(no, pos, text) for no, li, pos, text in grid if li == links]
        singles = [(no, pos) for no, pos, _ in rows if pos is not None]
        if len(singles) < 2 or 2 * len(singles) <= len(rows):
            continue
        out += [f"{no}: one record per row, as in the rest of its table, does not hold {text.strip()[:80]}"
                for no, pos, text in rows if pos is None]
        out += [f"{singles[0][0]}: {p}" for p in column_problems(singles)]
    return out


@pytest.mark.parametrize("page", PAGES)
def test_figures_come_from_results(page):
    path = ROOT / page
    if not path.is_file():
        pytest.skip(f"{page} not written")
    problems = check_page(path)
    assert not problems, "\n".join(problems)


def test_pages_exist():
    assert (ROOT / "README.md").is_file()
    assert {"how-it-works.md", "performance.md", "training.md", "testing.md", "contributing.md"} <= {
        p.name for p in (ROOT / "docs").glob("*.md")}


# the checker itself: a right figure passes, a wrong one, an uncited one or a mixed row fails


def _page(tmp_path, body: str) -> Path:
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(body)
    return page


@pytest.fixture
def fake_results(monkeypatch, tmp_path):
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "fake.json").write_text(json.dumps({"records": [
        {"M": 131072, "k": 29, "dense_ms": 14.4487, "twell_ms": 8.9077, "speedup": 1.6221, "kernels_speedup": 1.5512,
         "peak_bytes": 3 * 2**30, "dense_peak_bytes": 4 * 2**30},
        {"M": 16384, "k": 29, "dense_ms": 1.8186, "twell_ms": 1.1932, "speedup": 1.5242},
        {"variant": "dense", "tok_per_ms": 87.836, "mj_per_token": 7.8529},
        {"variant": "twell", "tok_per_ms": 99.837, "mj_per_token": 6.9257},
    ]}))
    monkeypatch.setitem(globals(), "RESULTS", results.resolve())
    monkeypatch.setitem(globals(), "ROOT", tmp_path.resolve())
    return results


def test_figures_extracted():
    got = [(f.text, f.value, f.unit) for f in figures("1.62x and 14.45 ms, 7.85 mJ, 105.1k tokens/s, 3.0 GiB, 40%, "
                                                      "k 29, d 2048, bf16, H100, 16 x 2048, 0.7397 and 2.3e-3, 0.5b, "
                                                      "5.39 / 68.96 GiB, Triton 3.6.0")]
    assert got == [("1.62x", 1.62, "x"), ("14.45 ms", 14.45, "ms"), ("7.85 mJ", 7.85, "mJ"),
                   ("105.1k tokens/s", 105100.0, "tokens/s"), ("3.0 GiB", 3.0, "GiB"), ("40%", 40.0, "%"),
                   ("0.7397", 0.7397, ""), ("2.3e-3", 0.0023, ""), ("5.39", 5.39, "GiB"), ("68.96 GiB", 68.96, "GiB")]


def test_checker_accepts_right_figures(tmp_path, fake_results):
    page = _page(tmp_path, "At 131072 tokens twell takes 8.91 ms against 14.45 ms: 1.62x, with 3.0 GiB at peak.\n"
                           "The whole model reads 87.8 and 99.8 tokens/ms (1.14x), 7.85 and 6.93 mJ (0.88x).\n"
                           "From 1.52x to 1.62x ([fake](../benchmarks/results/fake.json)).\n\n"
                           "| M | dense | twell |\n|---|---|---|\n| 16384 | 1.819 ms | 1.193 ms (1.52x) |\n")
    assert check_page(page) == []


@pytest.mark.parametrize("wrong", ["8.91 ms against 14.45 ms: 1.63x", "8.92 ms against 14.45 ms: 1.62x",
                                   "8.91 ms against 1.818 ms", "87.8 and 99.8 tokens/ms (1.15x)"])
def test_checker_catches_a_wrong_figure(tmp_path, fake_results, wrong):
    page = _page(tmp_path, f"Twell: {wrong} ([fake](../benchmarks/results/fake.json)).\n")
    assert len(check_page(page)) == 1


def test_checker_catches_uncited_and_missing(tmp_path, fake_results):
    page = _page(tmp_path, "Dense takes 14.45 ms.\n\nIt reads 1.62x ([gone](../benchmarks/results/gone.json)).\n\n"
                           "| M | twell |\n|---|---|\n| 16384 | 1.52x |\n")
    problems = check_page(page)
    assert len(problems) == 4, problems  # uncited; missing file; its figure uncited; the table inherits none
    page = _page(tmp_path, "Settings only: k 29, M 131072, d 2048; `14.45 ms` in code.\n\n```\n3.0 GiB\n```\n\n"
                           "<!-- settings -->\nA threshold: at most 0.6% of f.\n")
    assert check_page(page) == []
    assert len(check_page(_page(tmp_path, "A threshold: at most 0.6% of f.\n"))) == 1


def test_checker_catches_a_column_that_mixes_fields(tmp_path, fake_results):
    table = ("From [fake](../benchmarks/results/fake.json):\n\n| M | dense | twell | ratio |\n|---|---|---|---|\n"
             "| 131072 | 14.45 ms | 8.91 ms | {} |\n| 16384 | 1.819 ms | 1.193 ms | 1.52x |\n")
    assert check_page(_page(tmp_path, table.format("1.62x"))) == []
    problems = check_page(_page(tmp_path, table.format("1.55x")))  # the record's kernels_speedup, not its speedup
    assert len(problems) == 1 and "column 4" in problems[0], problems


# ---------------------------------------------------------------------------------------------
# build history stays in git

_SKIP_DIRS = {".git", ".venv", "venv", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis", ".mypy_cache",
              ".ruff_cache", "node_modules", ".tox", ".eggs"}
_TENS = "twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety"
_ONES = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth"
FORBIDDEN = [
    ("issue number", re.compile(r"\bissues?\s*#?\s*\d+", re.I)),
    ("work-period word", re.compile(r"\bsess" + r"ions?\b", re.I)),
    ("work-period ordinal", re.compile(rf"\b(?:{_TENS})-\s*(?:#\s*)?(?:{_ONES})\b", re.I)),
    ("work-period ordinal", re.compile(r"\b(?:thir|four|fif|six|seven|eigh|nine)teenth\b|\b(?:twen|thir|for|fif|six)tieth\b",
                                       re.I)),
    ("run tag", re.compile(r"(?<![A-Za-z0-9.])s\d{2,3}(?![A-Za-z0-9])")),
]


def history_words(text: str) -> list[tuple[int, str, str]]:
    """(line, kind, match) of each forbidden phrase in ``text``."""
    hits = []
    for kind, pattern in FORBIDDEN:
        for m in pattern.finditer(text):
            hits.append((text.count("\n", 0, m.start()) + 1, kind, " ".join(m.group(0).split())))
    return sorted(hits)


def _text_files():
    """The repository's .md, .py and .sh files: tracked or new, not ignored (git's own list when
    git is there; else a walk that skips virtual environments, caches and build folders)."""
    try:
        listed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard"], capture_output=True,
                                text=True, timeout=30, check=True).stdout.splitlines()
        paths = [ROOT / p for p in listed]
    except (OSError, subprocess.SubprocessError):
        paths = []
        for dirpath, dirnames, filenames in os.walk(ROOT):
            dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.endswith(".egg-info")]
            paths += [Path(dirpath) / name for name in filenames]
    for path in paths:
        if path.suffix in (".md", ".py", ".sh") and path.is_file():
            yield path


def test_no_build_history_in_text_files():
    hits = []
    for path in _text_files():
        for line, kind, word in history_words(path.read_text(errors="replace")):
            hits.append(f"{path.relative_to(ROOT)}:{line}: {kind}: {word!r}")
    assert not hits, f"{len(hits)} phrases about how the project was built (history lives in git):\n" + "\n".join(hits)


@pytest.mark.parametrize("text,n", [
    ("see issue " + "11 and issue " + "#12; Issues " + "9", 3), ("as in the fifty-" + "sixth " + "sess" + "ion", 2),
    ("runtime_probe/s" + "56/x.json, run s" + "51 call 2", 2), ("the twenty-" + "\n# second", 1),
    ("it issued 3 calls; the issue is open; the first call; s1 = stream; cvt.s32; sm90; 29s", 0),
])
def test_history_words_found(text, n):
    assert len(history_words(text)) == n
