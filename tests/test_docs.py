"""The docs stay true: every option table matches its class's signature, every relative link
resolves, the outputs a page shows are what the commands print, and no file of the tree names
a path of a developer's machine."""

from __future__ import annotations

import ast
import enum
import inspect
import json
import re
import shlex
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import streamcache
from streamcache.cli.main import main

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"

# Built from pieces so that this file does not name them itself.
_WORK, _HOME, _USERS = "/" + "work/", "/" + "home/", "/" + "Users/"
DEVELOPER_PATH = re.compile(rf"{re.escape(_WORK)}|{re.escape(_HOME)}[A-Za-z_]|{re.escape(_USERS)}")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".cfg", ".txt", ".sh", ".yml", ".yaml"}
TEXT_NAMES = {".ci/run"}


def _files_of_the_tree() -> list[str]:
    """Tracked files and new ones that git does not ignore (what a commit would hold)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=REPO, capture_output=True, check=True).stdout.decode()
    return sorted(set(filter(None, listed.split("\0"))))


def test_no_file_names_a_path_of_a_developers_machine() -> None:
    found = []
    for name in _files_of_the_tree():
        path = REPO / name
        if not (Path(name).suffix in TEXT_SUFFIXES or name in TEXT_NAMES) or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if DEVELOPER_PATH.search(line):
                found.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not found, ("paths of a developer's machine (write the plain command, relative to "
                       "the repository):\n" + "\n".join(found))


def test_the_path_check_knows_a_developers_paths() -> None:
    for line in (f"flock {_WORK}team/bench.lock python x.py", f"{_HOME}alice/data", f"{_USERS}bob"):
        assert DEVELOPER_PATH.search(line), line
    for line in ("mkdtemp(dir='/tmp/x')", "/dev/shm/streamcache-mem", "~/.cache/streamcache"):
        assert not DEVELOPER_PATH.search(line), line


# --- option tables against the signatures ---------------------------------------------------

OPTION_TABLES = [  # (class, the page whose table lists its keywords)
    (streamcache.StreamDataset, "training.md"),
    (streamcache.StreamLoader, "training.md"),
    (streamcache.Checkpointer, "checkpoint.md"),
    (streamcache.ShardWriter, "writing.md"),
]


def _cells(row: str) -> list[str]:
    """The cells of a Markdown table row (``\\|`` inside a cell is not a separator)."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def markdown_tables(text: str) -> Iterator[list[list[str]]]:
    """Each table of ``text`` as rows of cells, the header first, the separator left out."""
    rows: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.lstrip().startswith("|"):
            rows.append(_cells(line))
            continue
        if len(rows) >= 2:
            yield [rows[0], *rows[2:]]
        rows = []


def options_table(cls: type, page: str) -> list[list[str]]:
    """The table of ``page`` whose header's first cell is `` `ClassName(...` ``."""
    text = (DOCS / page).read_text()
    for table in markdown_tables(text):
        if table[0][0].startswith(f"`{cls.__name__}("):
            return table
    raise AssertionError(f"docs/{page} has no table whose header is `{cls.__name__}(...)`")


def _written_defaults(cls: type) -> dict[str, str]:
    """Each keyword's default as the source of ``__init__`` writes it (empty if unreadable)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls.__init__))  # type: ignore[misc]
    except (OSError, TypeError):
        return {}
    function = ast.parse(source).body[0]
    assert isinstance(function, ast.FunctionDef)
    arguments = function.args
    positional = arguments.posonlyargs + arguments.args
    with_defaults = positional[len(positional) - len(arguments.defaults):]
    pairs = list(zip(with_defaults, arguments.defaults, strict=True))
    keyword_only = zip(arguments.kwonlyargs, arguments.kw_defaults, strict=True)
    pairs += [(a, d) for a, d in keyword_only if d is not None]
    return {argument.arg: ast.unparse(default) for argument, default in pairs}


def default_spellings(default: object, written: str | None) -> set[str]:
    """How a table may write ``default``: its repr, as the signature writes it, a string in
    double quotes, an enum by its value."""
    spellings = {repr(default)}
    if written:
        spellings.add(written)
    if isinstance(default, enum.Enum):
        spellings |= {f"{type(default).__name__}.{default.name}"}
        default = default.value
        spellings.add(repr(default))
    if isinstance(default, str):
        spellings.add(json.dumps(default))
    return spellings


def keyword_parameters(cls: type) -> dict[str, inspect.Parameter]:
    """The public parameters of ``cls.__init__`` that have a default (skipping ``self``,
    ``*args`` and ``**kwargs``)."""
    parameters = inspect.signature(cls.__init__).parameters  # type: ignore[misc]
    return {name: p for name, p in parameters.items()
            if name != "self" and not name.startswith("_") and p.default is not p.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


@pytest.mark.parametrize(("cls", "page"), OPTION_TABLES, ids=lambda x: getattr(x, "__name__", x))
def test_every_keyword_is_in_the_docs_with_its_default(cls: type, page: str) -> None:
    table = options_table(cls, page)
    rows = {}
    for row in table[1:]:
        match = re.fullmatch(r"`(\w+)`", row[0])
        assert match, f"docs/{page}, {cls.__name__} table: first cell {row[0]!r} is not a `keyword`"
        rows[match.group(1)] = row
    written = _written_defaults(cls)
    problems = []
    for name, parameter in keyword_parameters(cls).items():
        spellings = default_spellings(parameter.default, written.get(name))
        if name not in rows:
            problems.append(f"`{name}` (default {sorted(spellings)[0]}) has no row")
            continue
        shown = re.findall(r"`([^`]+)`", rows[name][1]) if len(rows[name]) > 1 else []
        if not spellings & set(shown):
            problems.append(f"`{name}`: the default cell says {rows[name][1]!r}; the signature's "
                            f"default is {' or '.join(sorted(spellings))}")
    stale = sorted(set(rows) - set(keyword_parameters(cls)))
    problems += [f"`{name}` has a row but is no keyword of {cls.__name__}" for name in stale]
    assert not problems, (f"docs/{page}, the `{cls.__name__}(...)` table against "
                          f"{cls.__name__}.__init__:\n  " + "\n  ".join(problems))


def test_the_table_check_names_a_missing_keyword_and_a_wrong_default(tmp_path: Path,
                                                                     monkeypatch) -> None:
    class Small:
        def __init__(self, url: str, *, window: int = 4096, mode: str = "fast") -> None: ...

    page = tmp_path / "small.md"
    page.write_text("| `Small(url, ...)` | default | |\n|---|---|---|\n| `window` | `4095` | |\n")
    monkeypatch.setattr(f"{__name__}.DOCS", tmp_path)
    with pytest.raises(AssertionError) as failure:
        test_every_keyword_is_in_the_docs_with_its_default(Small, "small.md")
    assert "`window`: the default cell says '`4095`'" in str(failure.value)
    assert "`mode` (default" in str(failure.value) and "has no row" in str(failure.value)


def test_the_table_check_reads_the_defaults_as_written() -> None:
    checkpointer = _written_defaults(streamcache.Checkpointer)
    assert checkpointer["timeout"] == "datetime.timedelta(minutes=30)"
    assert default_spellings(streamcache.Checkpointer.__init__.__kwdefaults__["async_mode"],
                             None) >= {'"thread"', "AsyncMode.THREAD"}


# --- links ----------------------------------------------------------------------------------

def markdown_pages() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.glob("*.md")), REPO / "benchmarks" / "RESULTS.md"]


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and code spans (links there are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: the text as rendered, lower case, punctuation other
    than ``-`` and ``_`` removed, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link reads as its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, flags=re.M):
        slug, suffix = github_slug(heading), 0
        while (slug if suffix == 0 else f"{slug}-{suffix}") in found:
            suffix += 1
        found.add(slug if suffix == 0 else f"{slug}-{suffix}")
    return found


def relative_links(page: Path) -> Iterator[tuple[int, str]]:
    for number, line in enumerate(_prose(page.read_text()).splitlines(), 1):
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", line):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                yield number, target


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in markdown_pages():
        for _, target in relative_links(page):
            path_part, _, anchor = target.partition("#")
            destination = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(REPO)}: ({target})"
            if not destination.exists():
                broken.append(f"{where}: no file {destination.relative_to(REPO)}")
            elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
                broken.append(f"{where}: no heading #{anchor} in "
                              f"{destination.relative_to(REPO)}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_github_slugs() -> None:
    assert github_slug("Randomness (the contract)") == "randomness-the-contract"
    assert github_slug("Loader states (`StreamLoader.state_dict()`, `load_state_dict`)") == \
        "loader-states-streamloaderstate_dict-load_state_dict"
    assert github_slug("The lease: one job writes a root") == "the-lease-one-job-writes-a-root"


# --- what the pages show --------------------------------------------------------------------

def test_goodput_output_shown_in_the_cli_page_is_what_it_prints(capsys) -> None:
    text = (DOCS / "cli.md").read_text()
    match = re.search(r"For example, `streamcache (goodput [^`]*)` prints\s*```\n(.*?)```", text,
                      re.S)
    assert match is not None, "docs/cli.md no longer shows a goodput example"
    assert main(shlex.split(match.group(1))) == 0
    assert capsys.readouterr().out == match.group(2)


def _python_blocks(page: Path) -> Iterator[str]:
    yield from (m.group(1) for m in re.finditer(r"```python\n(.*?)```", page.read_text(), re.S))


def test_the_examples_call_the_classes_with_keywords_they_take() -> None:
    """A keyword in a page's example that the class does not take would be a TypeError."""
    classes = {cls.__name__: cls for cls, _ in OPTION_TABLES}
    wrong = []
    for page in markdown_pages():
        for block in _python_blocks(page):
            try:
                tree = ast.parse(block)
            except SyntaxError:
                assert page.name != "README.md", f"a README example does not parse:\n{block}"
                continue
            for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
                name = getattr(call.func, "id", getattr(call.func, "attr", None))
                if name not in classes:
                    continue
                taken = inspect.signature(classes[name].__init__).parameters  # type: ignore[misc]
                wrong += [f"{page.relative_to(REPO)}: {name}({k.arg}=...)" for k in call.keywords
                          if k.arg is not None and k.arg not in taken]
    assert not wrong, "keywords the classes do not take:\n" + "\n".join(wrong)
