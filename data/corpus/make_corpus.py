#!/usr/bin/env python3
"""Regenerate ``stdlib_docstrings.txt``: docstrings harvested from Python's standard library.

    python data/corpus/make_corpus.py            # writes data/corpus/stdlib_docstrings.txt
    python data/corpus/make_corpus.py --check    # exit 1 if the shipped file differs

This is a one-off maintenance script: nothing at run time calls it, the
training example only reads the text file it produced (see SOURCES.md for the
interpreter it was run with; another Python version gives a different text).

Format of the output: plain ASCII, one document per docstring, documents
separated by exactly one blank line; a docstring's own blank lines are dropped
so a blank line always means "next document". Lines keep their relative
indentation (``inspect.cleandoc``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import sys
import warnings
from pathlib import Path

# Pure-Python, well-documented modules, in harvest order. Fixed list: the
# output must not depend on what else happens to be installed.
MODULES = [
    "argparse", "ast", "asyncio.base_events", "asyncio.events", "asyncio.futures",
    "asyncio.locks", "asyncio.queues", "asyncio.streams", "asyncio.tasks",
    "asyncio.transports", "bisect", "calendar", "cmd", "codecs", "collections",
    "concurrent.futures._base", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "difflib", "email.message", "email.utils", "enum", "fractions",
    "ftplib", "functools", "getopt", "gettext", "glob", "gzip", "heapq", "hmac",
    "html.parser", "http.client", "http.cookies", "http.server", "imaplib",
    "inspect", "ipaddress", "json", "json.decoder", "json.encoder", "logging",
    "logging.handlers", "mailbox", "netrc", "numbers", "optparse", "os", "pathlib",
    "pickle", "pprint", "queue", "random", "re", "sched", "secrets", "selectors",
    "shlex", "shutil", "smtplib", "socketserver", "statistics", "string",
    "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "tokenize", "traceback", "typing", "unittest.case", "unittest.mock",
    "urllib.parse", "urllib.request", "uuid", "warnings", "weakref",
    "xml.dom.minidom", "zipfile", "_pydecimal", "datetime",
]

MAX_BYTES = 280_000  # hard limit for the shipped file is 300 KB
PER_MODULE_BYTES = 4_000  # spread the budget over many modules and styles
MIN_CHARS = 60  # skip one-liners like "Return self."
OUT = Path(__file__).resolve().parent / "stdlib_docstrings.txt"


def _docstrings(module_name: str) -> list[str]:
    """Module, class, function and method docstrings defined in the module, in name order."""
    module = importlib.import_module(module_name)
    found = [module.__doc__]
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isclass(obj):
            found.append(obj.__doc__)
            for attr, member in sorted(vars(obj).items()):
                if attr.startswith("_") and attr != "__init__":
                    continue
                member = getattr(member, "__func__", member)  # classmethod/staticmethod
                if inspect.isfunction(member) or isinstance(member, property):
                    found.append(member.__doc__)
        elif inspect.isfunction(obj):
            found.append(obj.__doc__)
    return [doc for doc in found if isinstance(doc, str)]


def _clean(doc: str) -> str | None:
    lines = [line.rstrip() for line in inspect.cleandoc(doc).splitlines()]
    text = "\n".join(line for line in lines if line.strip())
    if len(text) < MIN_CHARS or not text.isascii() or "\t" in text:
        return None
    return text


def build() -> str:
    seen: set[str] = set()
    parts: list[str] = []
    size = 0
    warnings.simplefilter("ignore")  # deprecated aliases (typing.io) warn when touched
    for module_name in MODULES:
        module_size = 0
        for doc in _docstrings(module_name):
            text = _clean(doc)
            if text is None or text in seen or module_size + len(text) > PER_MODULE_BYTES:
                continue
            if size + len(text) + 2 > MAX_BYTES:
                return "\n\n".join(parts) + "\n"
            seen.add(text)
            parts.append(text)
            size += len(text) + 2
            module_size += len(text)
    return "\n\n".join(parts) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the shipped file instead of writing")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    text = build()
    digest = hashlib.sha256(text.encode()).hexdigest()
    print(f"Python {sys.version.split()[0]}: {len(text.encode())} bytes, "
          f"{text.count(chr(10) * 2) + 1} documents, sha256 {digest}")
    if args.check:
        same = args.out.is_file() and args.out.read_text(encoding="ascii") == text
        print("identical to" if same else "DIFFERS from", args.out)
        return 0 if same else 1
    args.out.write_text(text, encoding="ascii")
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
