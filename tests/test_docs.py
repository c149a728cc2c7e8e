"""The documentation holds: every relative link and image in README.md, docs/*.md and results/**/README.md
resolves (anchors to headings included), the README stays a front page (at most 200 lines), and every
`lossless ...` command shown in a code block of README.md or docs/*.md runs, in-process through
`lossless.cli.main`, on a tiny random model with a few tokens.

Commands are rewritten by the explicit tables below (REPLACE, ADD, the positional rules in `rewrite`), so a doc
line is run with its own subcommand and options, only smaller. Shell lines that are not `lossless` commands are
listed in NOT_RUN with the reason; any other shell line in a code block fails the test, so none escapes.
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import save_tiny_model_dir

from lossless.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK_FILES = [*DOC_FILES, *sorted((ROOT / "results").glob("**/README.md"))]
README_MAX_LINES = 200
THE_README_EXAMPLE = 'lossless generate "Summarise: ..."'

# Shell lines in code blocks that are not run here, by how they start, with the reason.
NOT_RUN = {
    "make ": "Makefile targets install packages and run for minutes to days on the embedded model",
    "python benchmarks/": "benchmarks time the embedded model for minutes; tests/ covers what they call",
    "accelerate launch ": "multi-process launch (tests/test_audit.py and tests/test_training.py cover the ranks)",
    "lm_eval ": "the harness's own command; tests/test_harness.py runs it on a tiny model",
    "curl ": "talks to a running `lossless serve`; tests/serving/test_server.py sends these requests to a live server",
    "CMAKE_ARGS=": "builds llama.cpp from source for minutes: an optional peer of the speed benchmark, never installed for tests",
    "pip download llama-cpp-python": "fetches llama.cpp's sources for llama-server, an optional peer of serve_load.py",
    "tar xzf llama_cpp_python": "unpacks those sources",
    "cmake ": "builds llama-server from those sources for minutes (`make llama-server` does the same, once per CPU)",
    "lossless audit --configs bf16/llama.cpp": "decodes with llama.cpp's server on the embedded model's GGUF (not the "
                                               "tiny model): tests/study/test_llamacpp.py runs such an audit",
    "lossless report runs/llama ": "reports that audit: tests/study/test_llamacpp.py reports one, and one against "
                                   "another run's reference (--reference-from)",
}

FENCE = re.compile(r"^(\s*)(```|~~~)(.*)$")
SHELL_INFO = {"", "sh", "bash", "shell", "console"}


# ------------------------------------------------------------------------------------------ markdown
def _blocks(text: str):
    """(info string, first line number, lines) of every fenced code block."""
    out, lines, info, start = [], None, "", 0
    for i, line in enumerate(text.splitlines(), start=1):
        m = FENCE.match(line)
        if m and lines is None:
            lines, info, start = [], m.group(3).strip(), i + 1
        elif m and lines is not None:
            out.append((info, start, lines))
            lines = None
        elif lines is not None:
            lines.append(line)
    return out


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans (whose brackets are not links)."""
    kept, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            inside = not inside
            kept.append("")
            continue
        kept.append("" if inside else re.sub(r"`[^`]*`", "", line))
    return "\n".join(kept)


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: formatting dropped, lower case, punctuation removed, spaces to '-'."""
    text = re.sub(r"[`*_]", "", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for line in _prose(path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


@pytest.mark.parametrize("doc", LINK_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_image_resolves(doc):
    broken = []
    for target in LINK.findall(_prose(doc.read_text(encoding="utf-8"))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{target}: no heading '#{anchor}' in {dest.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_the_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    linked = {Path(t.partition("#")[0]).name for t in LINK.findall(_prose(index))}
    pages = {p.name for p in DOC_FILES if p.parent.name == "docs" and p.name != "README.md"}
    assert pages <= linked, f"docs/README.md does not link {sorted(pages - linked)}"


def test_results_has_one_folder_per_experiment():
    results = ROOT / "results"
    loose = sorted(p.name for p in results.iterdir() if p.is_file() and p.name != "README.md")
    assert not loose, f"loose files in results/: {loose}"
    index = (results / "README.md").read_text(encoding="utf-8")
    for folder in sorted(p for p in results.iterdir() if p.is_dir()):
        assert (folder / "README.md").is_file(), f"results/{folder.name}/ has no README.md"
        assert f"]({folder.name}/" in index, f"results/README.md does not index {folder.name}/"


# ------------------------------------------------------------------------------------------ commands
@dataclass(frozen=True)
class Command:
    doc: str  # path relative to the repository
    line: int
    text: str  # the line as shown (continuations joined)

    @property
    def argv(self) -> list[str]:
        tokens = shlex.split(self.text, comments=True)
        assert tokens[0] == "lossless"
        return [t for t in tokens[1:] if t != "..."]  # a bare `...` stands for "more options"


def _shell_lines(doc: Path):
    for info, start, lines in _blocks(doc.read_text(encoding="utf-8")):
        if info.split()[:1] and info.split()[0] not in SHELL_INFO:
            continue
        joined, first = "", None
        for offset, line in enumerate(lines):
            if first is None:
                first = start + offset
            joined += line.rstrip()
            if joined.endswith("\\"):
                joined = joined[:-1] + " "
                continue
            if joined.strip():
                yield first, joined.strip()
            joined, first = "", None


def collect() -> tuple[list[Command], list[tuple[str, int, str]]]:
    commands, strays = [], []
    for doc in DOC_FILES:
        rel = str(doc.relative_to(ROOT))
        for line, text in _shell_lines(doc):
            if any(text.startswith(p) for p in NOT_RUN):
                continue
            if text.startswith("lossless "):
                commands.append(Command(rel, line, text))
            elif not text.startswith("#"):
                strays.append((rel, line, text))
    return commands, strays


COMMANDS, STRAYS = collect()


def test_every_shell_line_is_run_or_listed_as_not_run():
    assert not STRAYS, f"shell lines neither run nor listed in NOT_RUN: {STRAYS}"
    assert any(c.doc == "README.md" and c.text.startswith(THE_README_EXAMPLE) for c in COMMANDS)
    shown = [text for doc in DOC_FILES for _, text in _shell_lines(doc)]
    for prefix in NOT_RUN:  # the list does not outlive the lines it excuses
        assert any(t.startswith(prefix) for t in shown), f"NOT_RUN entry {prefix!r} matches no shell line"


TINY_WORDS = "w1 w2 w3"
PROBE_TEXT = " ".join(f"w{i}" for i in range(1, 15))  # longer than the head's k
FLAGS = {"--json", "--no-chat-template", "--no-progress", "--at-rest", "--confirm-run-unsafe-code", "--resume", "--all",
         "--remeasure", "--profile"}
OPTIONAL_NUMBER = {"--tree", "--lookup"}  # a number follows only sometimes
OUTPUTS = ("--out", "--log", "--publish")  # written: always under the workspace
MODEL_COMMANDS = {"generate", "audit", "train", "distill", "probe", "eval", "serve", "costs"}

# option -> new value, for every subcommand that has the option (a callable gets (value, workspace))
REPLACE = {
    "--model": lambda v, ws: ws.tiny.model,
    "--max-new-tokens": "4",
    "--limit-per-domain": "1",
    "--limit": "1",
    "--steps": "1",
    "--eval-prompts": "0",
    "--eval-sequences": "2",
    "--suite": lambda v, ws: ws.tiny.suite,
    "--prompts": lambda v, ws: ws.tiny.prompts,
    "--configs": lambda v, ws: re.sub(r":\d+", ":1", v),  # one prompt per domain
    "--head": lambda v, ws: ws.head(v),
    "--distill-dir": lambda v, ws: ws.distilled(v),
    "--eval-distill-dir": lambda v, ws: ws.distilled(v),
    **{opt: (lambda v, ws: ws.path(v)) for opt in OUTPUTS},
}
# options added where the doc line leaves them at a default that is slow or outside the workspace
ADD = {
    "generate": {"--max-new-tokens": "4"},
    "probe": {},
    "audit": {"--suite": None, "--limit-per-domain": "1", "--max-new-tokens": "4", "--no-progress": None},
    "report": {},
    "backfill": {"--no-progress": None},
    "train": {"--prompts": None, "--distill-dir": None, "--steps": "1", "--eval-prompts": "0",
              "--max-new-tokens": "4", "--no-progress": None},
    "distill": {"--prompts": None, "--max-new-tokens": "4", "--no-progress": None},
    "curve": {},
    "eval": {"--limit": "1", "--no-progress": None},
    "tasks": {},
    "serve": {},
    "costs": {},
}


def _parse(argv: list[str]) -> tuple[str, list[tuple[str, str | None]], list[str]]:
    """(subcommand, [(option, value or None)], positionals), by the FLAGS / OPTIONAL_NUMBER tables."""
    sub, rest = argv[0], argv[1:]
    options, positionals, i = [], [], 0
    while i < len(rest):
        tok = rest[i]
        if tok.startswith("--"):
            name, eq, value = tok.partition("=")
            if eq:
                options.append((name, value))
            elif name in FLAGS:
                options.append((name, None))
            elif name in OPTIONAL_NUMBER:
                takes = i + 1 < len(rest) and rest[i + 1].isdigit()
                options.append((name, rest[i + 1] if takes else None))
                i += takes
            else:
                options.append((name, rest[i + 1]))
                i += 1
        else:
            positionals.append(tok)
        i += 1
    return sub, options, positionals


def rewrite(argv: list[str], ws) -> list[str]:
    sub, options, positionals = _parse(argv)
    assert sub in ADD, f"no rewrite table for `lossless {sub}`: add one to ADD"
    present = {name for name, _ in options}
    added = dict(ADD[sub])
    if sub in MODEL_COMMANDS:
        added.setdefault("--model", None)
    for name, default in added.items():  # None: a flag, or a value REPLACE fills in
        if name not in present:
            options.append((name, default if default is not None or name in FLAGS else ""))
    out = [sub]
    for name, value in options:
        if name in REPLACE and value is not None:
            new = REPLACE[name]
            value = new(value, ws) if callable(new) else new
        out += [name] if value is None else [name, str(value)]
        if name in OUTPUTS:
            assert Path(value).is_relative_to(ws.root), f"{name} {value} is outside the workspace"
            if name == "--log":  # a file: its folder exists in the checkout (results/...), so here too
                Path(value).parent.mkdir(parents=True, exist_ok=True)
    if sub in ("generate",):
        positionals = [TINY_WORDS]
    elif sub == "probe":
        positionals = [PROBE_TEXT]
    elif sub in ("report", "backfill"):
        positionals = [ws.run(p) for p in positionals]
    elif sub == "curve":
        positionals = [str(ROOT / p) if (ROOT / p).is_file() else ws.path(p) for p in positionals]
    return out + positionals


# ----------------------------------------------------------------------------------------- workspaces
@dataclass
class Tiny:
    model: str
    suite: str
    prompts: str
    root: Path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Tiny:
    """A tiny Llama with a word-level tokenizer and a chat template (HumanEval asks in one), room for
    HumanEval's generation length, a two-domain suite and three training prompts."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("docs")
    model = save_tiny_model_dir(root / "tiny-llama")
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 1024
    (model / "config.json").write_text(json.dumps(config))
    suite = root / "suite.jsonl"
    suite.write_text("".join(json.dumps({"id": f"{d}-0", "domain": d, "prompt": p}) + "\n"
                             for d, p in (("poetry", "w4 w5 w6 w4 w5"), ("code", "w9 w8 w7"))))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n"
                               for i, p in enumerate(["w7 w8", "w3 w1 w2", "w11 w12 w13 w14"])))
    return Tiny(str(model), str(suite), str(prompts), root)


class Workspace:
    """Where one doc page's commands write: every repository path they name maps to the same place here, so a
    report finds the run an earlier audit of the page wrote, and a train the responses a distill wrote."""

    def __init__(self, root: Path, tiny: Tiny):
        self.root, self.tiny = root, tiny
        root.mkdir(parents=True, exist_ok=True)

    def path(self, rel: str) -> str:
        return str(self.root / rel.strip("/"))

    def head(self, value: str) -> str:
        """A head the page trained at that path, else the untrained one."""
        here = Path(self.path(value))
        return str(here) if (here / "head.json").is_file() else "none"

    def distilled(self, value: str) -> str:
        here = Path(self.path(value or "distill-default"))
        if not any(here.glob("*.jsonl*")):
            assert _run(["distill", "--model", self.tiny.model, "--prompts", self.tiny.prompts,
                         "--max-new-tokens", "4", "--no-progress", "--out", str(here)]) == 0
        return str(here)

    def run(self, value: str) -> str:
        """The run an earlier audit of the page wrote at that path, else a tiny audit run put there."""
        here = Path(self.path(value))
        if not (here / "run.json").is_file():
            assert _run(["audit", "--model", self.tiny.model, "--suite", self.tiny.suite, "--dtypes", "fp32",
                         "--max-new-tokens", "4", "--no-progress", "--out", str(here)]) == 0
        return str(here)


def _ask_the_server(self, sockets=None) -> None:
    """Stands in for uvicorn.Server.run: the app `lossless serve` built, served on a free port of 127.0.0.1 for as
    long as it takes to answer /health and a short chat request."""
    import asyncio
    import threading
    import time
    import urllib.request

    import uvicorn

    from conftest import free_port

    app = self.config.app
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()))
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive()
            time.sleep(0.05)
        url = f"http://127.0.0.1:{server.config.port}"
        with urllib.request.urlopen(url + "/health", timeout=60) as resp:
            assert resp.status == 200
        key = next(m.kwargs["api_key"] for m in app.user_middleware if "api_key" in m.kwargs)
        body = json.dumps({"messages": [{"role": "user", "content": TINY_WORDS}], "max_tokens": 4}).encode()
        req = urllib.request.Request(url + "/v1/chat/completions", data=body, method="POST",
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {key}"} if key else {})})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] >= 1
    finally:
        server.should_exit = True
        thread.join(30)


def _run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's own errors
        return exc.code if isinstance(exc.code, int) else 1


@pytest.fixture(scope="module")
def workspaces(tiny):
    made: dict[str, Workspace] = {}

    def get(doc: str) -> Workspace:
        if doc not in made:
            made[doc] = Workspace(tiny.root / "ws" / doc.replace("/", "_"), tiny)
            _write_example_modules(ROOT / doc, made[doc].root)
        return made[doc]
    return get


def _write_example_modules(doc: Path, where: Path) -> None:
    """A page's Python blocks that start with `# NAME.py` are modules its commands import (`module:function`)."""
    for info, _, lines in _blocks(doc.read_text(encoding="utf-8")):
        m = re.match(r"#\s*(\w+\.py)\b", lines[0]) if info == "python" and lines else None
        if m:
            (where / m.group(1)).write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("cmd", COMMANDS, ids=[f"{c.doc}:{c.line}" for c in COMMANDS])
def test_every_lossless_command_in_the_docs_runs(cmd, workspaces, monkeypatch, capsys):
    ws = workspaces(cmd.doc)
    monkeypatch.chdir(ws.root)  # `module:function` candidates import from the working directory
    monkeypatch.syspath_prepend(str(ws.root))
    argv = rewrite(cmd.argv, ws)
    if argv[0] == "serve":  # the server, loaded and asked over HTTP in-process, on a free port instead of the doc's
        monkeypatch.setattr("lossless.cli._check_bindable", lambda host, port: None)
        monkeypatch.setattr("uvicorn.Server.run", _ask_the_server)
    rc = _run(argv)
    captured = capsys.readouterr()
    for name in [m for m in sys.modules if m in {p.stem for p in ws.root.glob("*.py")}]:
        del sys.modules[name]
    assert rc == 0, f"{cmd.doc}:{cmd.line}: {cmd.text}\n  ran as: lossless {shlex.join(argv)}\n{captured.err[-3000:]}"
    assert "Traceback" not in captured.err

