"""Build calibration_data/mixed/: a small, diverse, licensed calibration corpus (issue #33).

Three kinds of text, about a third of the documents each, every document at least 40,000 characters (calibration
prompts are 2048-token passages cut at seeded offsets, 8 characters a token is ample):

  code_NN.txt.gz  Python standard library source (PSF-2.0), fixed groups of pure-Python modules, each file preceded
                  by a line `# file: <path relative to the stdlib>`;
  docs_NN.txt.gz  the long descriptions (README prose, markdown/rst) in the `*.dist-info/METADATA` of installed
                  packages whose declared licence is MIT, BSD or Apache-2.0, each preceded by a line
                  `# package: <name> <version> (licence: <licence>)`, at most 40,000 characters a package;
  math_NN.txt.gz  docstrings of public module-level functions in fixed numpy and scipy modules (BSD-3-Clause), read
                  with `ast` from the .py files (nothing is imported), each preceded by a line
                  `<module>.<function>(<arguments>)`; numpydoc "Examples" sections are dropped, so the text is
                  prose and formulas rather than doctest code.

Standard library only; the output depends only on the files read (deterministic order, gzip with mtime 0 and no
file name). Also writes mixed/SOURCES.md: each document's files or packages and their licences.

    .venv/bin/python calibration_data/build_mixed_corpus.py [--site-packages DIR] [--stdlib DIR] [--out DIR]

The docs part depends on which packages are installed: the shipped corpus was built with the project's .venv (its
purelib is the default when run with .venv/bin/python).
"""

from __future__ import annotations

import argparse
import ast
import email.message
import email.parser
import gzip
import re
import sys
import sysconfig
from pathlib import Path

MIN_CHARS = 40_000  # every document; prompts take 2048 tokens * 8 characters from a seeded offset
DOCUMENTS_PER_KIND = 8  # code, docs and math: a third of the documents each
PACKAGE_CAP = 40_000  # characters of one package's description (long changelogs are cut at a paragraph)

# Code: groups of stdlib modules, one document a group (60-120 KB each for Python 3.11).
CODE_GROUPS = (
    ("argparse.py",),
    ("difflib.py", "textwrap.py"),
    ("json/__init__.py", "json/decoder.py", "json/encoder.py", "json/scanner.py", "json/tool.py", "statistics.py"),
    ("fractions.py", "functools.py", "heapq.py", "bisect.py"),
    ("email/message.py", "email/feedparser.py", "email/parser.py", "email/generator.py"),
    ("email/header.py", "email/charset.py", "email/utils.py", "email/_parseaddr.py", "email/headerregistry.py"),
    ("asyncio/base_events.py", "asyncio/events.py"),
    ("asyncio/tasks.py", "asyncio/futures.py", "asyncio/locks.py", "asyncio/queues.py", "asyncio/streams.py"),
)

# Math: numpy and scipy modules whose public functions' docstrings are read, in this order.
MATH_MODULES = (
    "numpy/linalg/_linalg.py",
    "numpy/fft/_pocketfft.py",
    "numpy/lib/_function_base_impl.py",
    "numpy/polynomial/polynomial.py",
    "numpy/polynomial/chebyshev.py",
    "numpy/polynomial/legendre.py",
    "scipy/stats/_stats_py.py",
    "scipy/linalg/_basic.py",
    "scipy/linalg/_decomp.py",
    "scipy/linalg/_special_matrices.py",
    "scipy/integrate/_quadpack_py.py",
    "scipy/integrate/_quadrature.py",
    "scipy/optimize/_zeros_py.py",
    "scipy/optimize/_minimize.py",
    "scipy/signal/_filter_design.py",
    "scipy/special/_basic.py",
    "scipy/special/_orthogonal.py",
    "scipy/spatial/distance.py",
)
MATH_LICENCE = "BSD-3-Clause"  # numpy's and scipy's own source (LICENSE.txt of each)

# Packages left out whatever their licence: this project itself.
EXCLUDED_PACKAGES = {"kvcompile"}

# Text that must not reach a calibration document: the evaluation book, the calibration book, RULER's filler and the
# project's needles (calibration and evaluation). A unit (file, package, function) holding one is skipped.
BANNED = (
    "moby",
    "melville",
    "ishmael",
    "austen",
    "pride and prejudice",
    "mansfield park",
    "the grass is green",
    "the sky is blue",
    "the sun is yellow",
    "here we go. there and back again",
    "there and back again",
    "penmarch",
    "harbour street fish soup",
    "ilse marrow",
    "clockmaker of bremen",
    "thunder moon",
    "admiral quill",
)

PERMISSIVE = ("MIT", "BSD", "Apache-2.0")
_SPDX = {"MIT": "MIT", "0BSD": "BSD", "BSD-2-Clause": "BSD", "BSD-3-Clause": "BSD", "Apache-2.0": "Apache-2.0"}
_FREE_TEXT = {
    "mit": "MIT",
    "mit license": "MIT",
    "bsd": "BSD",
    "bsd license": "BSD",
    "new bsd": "BSD",
    "new bsd license": "BSD",
    "bsd-2-clause": "BSD",
    "bsd-3-clause": "BSD",
    "apache": "Apache-2.0",
    "apache 2.0": "Apache-2.0",
    "apache-2.0": "Apache-2.0",
    "apache 2.0 license": "Apache-2.0",
    "apache license 2.0": "Apache-2.0",
    "apache license, version 2.0": "Apache-2.0",
    "apache software license": "Apache-2.0",
}
_CLASSIFIERS = {
    "License :: OSI Approved :: MIT License": "MIT",
    "License :: OSI Approved :: BSD License": "BSD",
    "License :: OSI Approved :: Apache Software License": "Apache-2.0",
}
_EXAMPLES = re.compile(r"^[ \t]*Examples[ \t]*\n[ \t]*-{3,}[ \t]*$", re.M)


def main(argv: list[str] | None = None) -> int:
    paths = sysconfig.get_paths()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site-packages", type=Path, default=Path(paths["purelib"]))
    parser.add_argument("--stdlib", type=Path, default=Path(paths["stdlib"]))
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "mixed")
    args = parser.parse_args(argv)

    documents: list[tuple[str, str, list[str]]] = []  # (file name, text, source lines)
    documents += code_documents(args.stdlib)
    documents += docs_documents(args.site_packages)
    documents += math_documents(args.site_packages)

    for name, text, _ in documents:
        if len(text) < MIN_CHARS:
            raise SystemExit(f"{name}: {len(text)} characters, under {MIN_CHARS}")
        hit = banned_in(text)
        if hit:
            raise SystemExit(f"{name} holds banned text {hit!r}")

    args.out.mkdir(parents=True, exist_ok=True)
    names = {name for name, _, _ in documents}
    for old in sorted(args.out.glob("*.txt.gz")):
        if re.fullmatch(r"(code|docs|math)_\d+\.txt\.gz", old.name) and old.name not in names:
            old.unlink()
    for name, text, _ in documents:
        (args.out / name).write_bytes(gzip.compress(text.encode("utf-8"), compresslevel=9, mtime=0))
    (args.out / "SOURCES.md").write_text(sources_text(documents, args), encoding="utf-8")

    total = sum((args.out / name).stat().st_size for name in names)
    for name, text, _ in documents:
        print(f"{name:18s} {len(text):8,d} characters  {(args.out / name).stat().st_size:8,d} bytes gzip'd")
    print(f"{len(documents)} documents, {sum(len(t) for _, t, _ in documents):,d} characters, {total:,d} bytes gzip'd")
    return 0


# ---------------------------------------------------------------- code


def code_documents(
    stdlib: Path, groups: tuple[tuple[str, ...], ...] = CODE_GROUPS, prefix: str = "code"
) -> list[tuple[str, str, list[str]]]:
    """One document a group of stdlib modules, `<prefix>_NN.txt.gz`."""
    made = []
    for number, group in enumerate(groups, 1):
        parts, sources = [], []
        for relative in group:
            text = clean(read_text(stdlib / relative))
            if banned_in(text):
                print(f"skipped {relative}: banned text {banned_in(text)!r}", file=sys.stderr)
                continue
            parts.append(f"# file: {relative}\n{text}")
            sources.append(f"`{relative}` ({len(text):,d} characters)")
        made.append((f"{prefix}_{number:02d}.txt.gz", "\n\n".join(parts) + "\n", sources))
    return made


# ---------------------------------------------------------------- docs


def docs_documents(site_packages: Path) -> list[tuple[str, str, list[str]]]:
    pieces = []
    for metadata in sorted(site_packages.glob("*.dist-info/METADATA"), key=lambda p: p.parent.name.lower()):
        message = email.parser.Parser().parsestr(read_text(metadata), headersonly=False)
        name, version = str(message.get("Name", "")), str(message.get("Version", ""))
        if normalise(name) in EXCLUDED_PACKAGES:
            continue
        licence, declared = licence_of(message)
        if licence is None:
            continue
        text = clean(description_of(message))
        if not text:
            continue
        if banned_in(text):
            print(f"skipped package {name}: banned text {banned_in(text)!r}", file=sys.stderr)
            continue
        cut = ""
        if len(text) > PACKAGE_CAP:
            end = text.rfind("\n\n", 0, PACKAGE_CAP)
            end = end if end > PACKAGE_CAP // 2 else PACKAGE_CAP
            cut = f", first {end:,d} of {len(text):,d} characters"
            text = text[:end].rstrip()
        header = f"# package: {name} {version} (licence: {licence})"
        pieces.append((f"{header}\n\n{text}", f"{name} {version}: {licence} (declared: {declared}{cut})"))
    return [(f"docs_{n:02d}.txt.gz", text, sources) for n, (text, sources) in enumerate(pack(pieces), 1)]


def licence_of(message: email.message.Message) -> tuple[str | None, str]:
    """The package's licence if it is one of MIT, BSD, Apache-2.0 (or a choice or combination of only those), and
    the licence as declared. License-Expression first, then a short License field, then the License classifiers."""
    expression = str(message.get("License-Expression") or "").strip()
    if expression:
        return spdx_licence(expression), f"License-Expression {expression}"
    field = str(message.get("License") or "").strip()
    if field and "\n" not in field and len(field) <= 40:
        licence = spdx_licence(field) or _FREE_TEXT.get(field.lower())
        return licence, f"License {field}"
    classifiers = [str(c) for c in message.get_all("Classifier") or [] if str(c).startswith("License ::")]
    if classifiers:
        found = [_CLASSIFIERS.get(c) for c in classifiers]
        declared = "Classifier " + "; ".join(c.split("::")[-1].strip() for c in classifiers)
        if None in found:
            return None, declared
        return " OR ".join(dict.fromkeys(found)), declared  # several classifiers: the package offers each
    return None, "none"


def spdx_licence(expression: str) -> str | None:
    """MIT/BSD/Apache-2.0 for an SPDX expression of only those ids; an OR of alternatives needs one of them."""
    tokens = expression.replace("(", " ( ").replace(")", " ) ").split()
    ids = [t for t in tokens if t not in ("AND", "OR", "(", ")")]
    if "WITH" in tokens or not ids:
        return None
    if "OR" in tokens and "AND" not in tokens and "(" not in tokens:
        allowed = [_SPDX[i] for i in ids if i in _SPDX]
        return " OR ".join(dict.fromkeys(i for i in ids if i in _SPDX)) if allowed else None
    if all(i in _SPDX for i in ids):
        return " AND ".join(dict.fromkeys(ids))
    return None


def description_of(message: email.message.Message) -> str:
    body = message.get_payload()
    if isinstance(body, str) and body.strip():
        return body
    header = str(message.get("Description") or "")  # metadata 1.x: continuation lines indented by 8 spaces and "|"
    return "\n".join(re.sub(r"^ {8}\|?", "", line) for line in header.splitlines())


# ---------------------------------------------------------------- math


def math_documents(site_packages: Path) -> list[tuple[str, str, list[str]]]:
    pieces = []
    for relative in MATH_MODULES:
        path = site_packages / relative
        module = relative[: -len(".py")].replace("/", ".")
        tree = ast.parse(read_text(path), filename=str(path))
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            docstring = ast.get_docstring(node, clean=True)
            if not docstring:
                continue
            examples = _EXAMPLES.search(docstring)
            docstring = clean(docstring[: examples.start()] if examples else docstring)
            if len(docstring) < 200:  # a one-line summary is no passage
                continue
            if banned_in(docstring):
                print(f"skipped {module}.{node.name}: banned text {banned_in(docstring)!r}", file=sys.stderr)
                continue
            pieces.append((f"{module}.{node.name}({ast.unparse(node.args)})\n\n{docstring}", f"`{relative}`"))
    made = []
    for number, (text, sources) in enumerate(pack(pieces), 1):
        projects = dict.fromkeys(source.strip("`").split("/")[0] for source in sources)
        lines = [f"{project} {package_version(site_packages, project)} ({MATH_LICENCE})" for project in projects]
        lines += [
            f"{source} ({sources.count(source)} function{'s' * (sources.count(source) > 1)})"
            for source in dict.fromkeys(sources)
        ]
        made.append((f"math_{number:02d}.txt.gz", text, lines))
    return made


def package_version(site_packages: Path, project: str) -> str:
    for metadata in sorted(site_packages.glob(f"{project}-*.dist-info/METADATA")):
        return str(email.parser.Parser().parsestr(read_text(metadata), headersonly=True).get("Version", "?"))
    return "?"


# ---------------------------------------------------------------- helpers


def pack(pieces: list[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """Pieces, in order, into DOCUMENTS_PER_KIND documents of about equal size (whole pieces)."""
    if not pieces:
        raise SystemExit("no text found: check --site-packages")
    total = sum(len(text) + 2 for text, _ in pieces)
    count = DOCUMENTS_PER_KIND
    groups: list[tuple[list[str], list[str]]] = [([], []) for _ in range(count)]
    start = 0
    for text, source in pieces:
        middle = start + len(text) // 2
        texts, sources = groups[min(count - 1, middle * count // total)]
        texts.append(text)
        sources.append(source)
        start += len(text) + 2
    return [("\n\n".join(texts) + "\n", sources) for texts, sources in groups if texts]


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def clean(text: str) -> str:
    """Unix line ends, no trailing blanks, at most one blank line in a row, no byte-order mark."""
    text = text.replace("\r\n", "\n").replace("\r", "\n").lstrip("\ufeff")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n")


def banned_in(text: str) -> str | None:
    lowered = text.lower()
    return next((b for b in BANNED if b in lowered), None)


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def sources_text(documents: list[tuple[str, str, list[str]]], args: argparse.Namespace) -> str:
    lines = [
        "# Sources of calibration_data/mixed/",
        "",
        "Generated by `calibration_data/build_mixed_corpus.py` (see its docstring); do not edit by hand.",
        "",
        f"- code_*: Python {python_version(args.stdlib)} standard library source, PSF-2.0 (Python Software "
        "Foundation License Version 2; the stdlib's LICENSE.txt). Each file is preceded by `# file: <path>`.",
        "- docs_*: the long description of each package's `*.dist-info/METADATA`, preceded by `# package: "
        f"<name> <version> (licence: ...)`; only packages whose declared licence is MIT, BSD or Apache-2.0 (or a "
        f"choice or combination of only those); at most {PACKAGE_CAP:,d} characters a package, cut at a paragraph.",
        f"- math_*: docstrings of public module-level functions (numpy and scipy, {MATH_LICENCE}), read with `ast`, "
        "each preceded by `<module>.<function>(<arguments>)`; the numpydoc Examples sections are left out, and "
        "docstrings under 200 characters.",
        "",
    ]
    for name, text, sources in documents:
        lines += [f"## {name} ({len(text):,d} characters)", ""]
        if name.startswith("code_"):
            lines += [f"Python {python_version(args.stdlib)} stdlib, PSF-2.0:", ""]
        lines += [f"- {source}" for source in sources] + [""]
    return "\n".join(lines)


def python_version(stdlib: Path) -> str:
    if stdlib.resolve() == Path(sysconfig.get_paths()["stdlib"]).resolve():
        return ".".join(map(str, sys.version_info[:3]))
    match = re.search(r"python(\d+\.\d+)", str(stdlib))
    return match.group(1) if match else "3"


if __name__ == "__main__":
    raise SystemExit(main())
