#!/usr/bin/env python3
"""Planted bugs: does a set of tests still catch each one? (docs/testing.md, issue 37)

Each mutation replaces one snippet of the package (or of an example) by a wrong one, in a temporary copy of a
checkout (never in place), and runs the tests named for it there (``PYTHONPATH`` is the copy, so torchrun ranks
load the mutated code too). A bug is caught when a test fails under the mutation that passes without it (the
tests that failed are run again unmutated; those that fail anyway are left out and the rest run again, so a
checkout in flux still compares). Test paths that a checkout does
not have are skipped, so one list names a moved test file by its old and its new path; comparing the tests
before and after a change is two runs:

    git archive HEAD | tar -x -C /tmp/before     # the committed tests (read-only git)
    python3 bench/mutations.py --tree /tmp/before --json before.json
    python3 bench/mutations.py --json after.json  # this checkout

A mutation whose snippet a checkout lacks is reported as ``n/a`` (the code moved: update its snippet, and keep
the old place in ``moved`` so older checkouts still get the same bug).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    what: str  # the bug, in words
    path: str  # file of the checkout that is mutated
    old: str  # snippet replaced (must occur exactly once)
    new: str
    tests: tuple[str, ...]  # test files or node ids run under it (missing paths are skipped)
    # (path, old, new) where older checkouts hold the same code; the first place found once is mutated
    moved: tuple[tuple[str, str, str], ...] = ()

    def places(self) -> tuple[tuple[str, str, str], ...]:
        return ((self.path, self.old, self.new), *self.moved)


M = Mutation
MUTATIONS: tuple[Mutation, ...] = (
    # -- the six of the first session (docs/testing.md), planted again by this script
    M("warmup-off-by-one", "1F1B warm-up one forward short", "megatron_envpipe/core/schedule.py",
      "_stage_order(num_microbatches, num_stages - s - 1)", "_stage_order(num_microbatches, num_stages - s - 2)",
      ("tests/core/test_schedule.py", "tests/core/test_instructions.py")),
    M("deadlock-never-reported", "the deadlock check never raises", "megatron_envpipe/core/deadlock.py",
      'raise DeadlockError("deadlock: " + "; ".join(parts))', "return",
      ("tests/core/test_instructions.py", "tests/core/test_lazy_comm.py"),
      moved=(("megatron_envpipe/core/instructions.py", 'raise DeadlockError("deadlock: " + "; ".join(parts))',
              "return"),)),
    M("profile-takes-nan", "a profile CSV value of nan is read", "megatron_envpipe/core/profile_format.py",
      "    if not math.isfinite(number):\n        raise ProfileError(", "    if False:\n        raise ProfileError(",
      ("tests/core/test_profile.py", "tests/core/test_input_file_hardening.py", "tests/core/test_input_files.py"),
      moved=(("megatron_envpipe/core/profile.py", "    if not math.isfinite(number):\n        raise ProfileError(",
              "    if False:\n        raise ProfileError("),)),
    M("comm-timeout-unbounded", "--envpipe-comm-timeout has no upper bound (1e14 s reaches timedelta)",
      "megatron_envpipe/core/flag_ranges.py",
      '"comm_timeout_s": FlagRange("float", 0.0, 1e6,', '"comm_timeout_s": FlagRange("float", 0.0, 1e300,',
      ("tests/megatron/test_training_flag_hardening.py", "tests/megatron/test_training_flags.py",
       "tests/megatron/test_bad_flags.py")),
    M("extra-warmup-count-unchecked", "an extra warm-up list of the wrong length is accepted",
      "megatron_envpipe/core/schedule.py", "    if len(values) != num_stages:\n", "    if False:\n",
      ("tests/core/test_schedule.py", "tests/megatron/test_bad_flags.py",
       "tests/megatron/test_training_flag_hardening.py", "tests/megatron/test_training_flags.py")),
    M("pure-module-loads-numpy", "a pure module (core/schedule.py) imports numpy",
      "megatron_envpipe/core/schedule.py", "from __future__ import annotations\n",
      "from __future__ import annotations\nimport numpy  # noqa\n", ("tests/test_architecture.py",)),
    M("rank-error-traceback", "a rank's bad --envpipe-* flag ends in a traceback, not one line",
      "megatron_envpipe/apps/train_tiny_gpt.py",
      'raise SystemExit(f"{Path(sys.argv[0]).name}: error: {exc}") from None', "raise",
      ("tests/megatron/test_bad_flags.py", "tests/megatron/test_training_flag_hardening.py",
       "tests/megatron/test_training_flags.py")),
    M("negative-warmup-accepted", "a negative extra warm-up is accepted", "megatron_envpipe/core/schedule.py",
      '        if value < 0:\n            raise ScheduleError(f"extra warm-up of stage {s} is negative',
      '        if False:\n            raise ScheduleError(f"extra warm-up of stage {s} is negative',
      ("tests/core/test_schedule.py", "tests/apps/test_flag_hardening.py", "tests/apps/test_cli_flags.py",
       "tests/megatron/test_training_flag_hardening.py", "tests/megatron/test_training_flags.py")),
    M("virtual-stages-range-from-0", "--virtual-stages' lower bound off by one (0 accepted)",
      "megatron_envpipe/core/flag_ranges.py", '"virtual_stages": FlagRange("int", 1, 64,',
      '"virtual_stages": FlagRange("int", 0, 64,',
      ("tests/apps/test_flag_hardening.py", "tests/apps/test_cli_flags.py",
       "tests/megatron/test_training_flag_hardening.py", "tests/megatron/test_training_flags.py")),
    M("comm-timeout-default", "the --envpipe-comm-timeout default changed (300 s -> 30 s)",
      "megatron_envpipe/config/settings.py", "comm_timeout_s: float = 300.0", "comm_timeout_s: float = 30.0",
      ("tests/megatron/test_flag_defaults_documented.py", "tests/megatron/test_config.py",
       "tests/megatron/test_training_flag_hardening.py", "tests/megatron/test_training_flags.py",
       "tests/apps/test_docs_commands.py")),
    M("usage-error-exits-1", "a usage error exits 1, not 2", "megatron_envpipe/apps/cli/__init__.py",
      "return EXIT_USAGE if isinstance(exc, UsageError) else EXIT_FAILURE", "return EXIT_FAILURE",
      ("tests/apps/test_cli_errors.py", "tests/apps/test_flag_hardening.py", "tests/apps/test_cli_flags.py")),
    M("ctrl-c-exits-1", "Ctrl-C exits 1, not 130", "megatron_envpipe/apps/cli/__init__.py",
      "        return EXIT_INTERRUPTED\n", "        return 1\n",
      ("tests/apps/test_output_hardening.py", "tests/apps/test_cli_outputs.py")),
    M("umask-ignored", "new outputs are created 0600 whatever the umask", "megatron_envpipe/core/atomic.py",
      "fd = os.open(tmp, flags, 0o666)", "fd = os.open(tmp, flags, 0o600)",
      ("tests/apps/test_output_hardening.py", "tests/apps/test_cli_outputs.py")),
    M("hard-link-output-missed", "an output that is a hard link of an input is not refused",
      "megatron_envpipe/core/atomic.py",
      "return os.path.realpath(a) == os.path.realpath(b) or os.path.samefile(a, b)",
      "return os.path.realpath(a) == os.path.realpath(b)",
      ("tests/apps/test_output_hardening.py", "tests/apps/test_cli_outputs.py")),
    M("failed-rename-not-rolled-back", "a failed rename leaves the targets already replaced",
      "megatron_envpipe/core/atomic.py", "                os.replace(backup, target)\n", "                pass\n",
      ("tests/apps/test_output_hardening.py", "tests/apps/test_cli_outputs.py")),
    M("unknown-profile-column-accepted", "a profile with an unknown column is read", "megatron_envpipe/core/profile_format.py",
      "    if unknown:\n", "    if False:\n",
      ("tests/core/test_input_file_hardening.py", "tests/core/test_input_files.py",
       "tests/apps/test_file_hardening_cli.py", "tests/apps/test_cli_input_files.py"),
      moved=(("megatron_envpipe/core/profile.py", "    if unknown:\n", "    if False:\n"),)),
    M("duplicate-nvml-name-accepted", "a GPU table naming one NVML device twice is read",
      "megatron_envpipe/core/gpu_specs.py", "        if name in owners:\n", "        if False:\n",
      ("tests/core/test_input_file_hardening.py", "tests/core/test_input_files.py",
       "tests/apps/test_file_hardening_cli.py", "tests/apps/test_cli_input_files.py")),
    M("demo-blames-the-lost-peer", "a failed demo blames the rank that lost its peer, not the one with the error",
      "megatron_envpipe/apps/demo_errors.py", "key=lambda r: (bool(_PEER_GONE.search(errors[r][0])), ",
      "key=lambda r: (False, ", ("tests/apps/test_demo_hardening.py", "tests/apps/test_demo_checks.py"),
      moved=(("megatron_envpipe/apps/demo.py", "key=lambda r: (bool(_PEER_GONE.search(errors[r][0])), ",
              "key=lambda r: (False, "),)),
    M("demo-config-unknown-key", "a demo config's unknown key is not refused", "megatron_envpipe/apps/demo.py",
      "            if key not in known:\n", "            if False:\n",
      ("tests/apps/test_demo_config.py", "tests/apps/test_demo_hardening.py", "tests/apps/test_demo_checks.py")),
    M("held-activations-leak", "the executor never frees a micro-batch's held activations",
      "megatron_envpipe/megatron/stage_iteration.py",
      "        self.inputs.pop(key, None)\n        self.outputs.pop(key, None)\n        self.grads_out.pop(key, None)\n",
      "        pass\n",
      ("tests/megatron/test_executor.py::test_held_activations_are_freed_over_20_iterations",
       "tests/megatron/test_executor.py::test_held_activations_are_freed_over_6_iterations"),
      moved=(("megatron_envpipe/megatron/executor.py",  # before the split of issue 38
              "        self.inputs.pop(key, None)\n        self.outputs.pop(key, None)\n"
              "        self.grads_out.pop(key, None)\n", "        pass\n"),)),
    M("cli-parser-loads-torch", "the CLI's parser (a pure module) imports torch at load",
      "megatron_envpipe/apps/cli/parser.py", "from __future__ import annotations\n",
      "from __future__ import annotations\nimport torch  # noqa\n", ("tests/test_architecture.py",)),
)


def apply(tree: Path, mutation: Mutation) -> tuple[Path, str] | None:
    """Plants the bug in ``tree`` at the first of its places whose snippet occurs once there; the file and its
    original text (to put back), None when no place has it."""
    for rel, old, new in mutation.places():
        path = tree / rel
        if path.is_file() and (text := path.read_text()).count(old) == 1:
            path.write_text(text.replace(old, new, 1))
            return path, text
    return None


def failed_tests(tree: Path, tests: list[str], deselect: set[str], timeout_s: float,
                 first: bool = True) -> tuple[set[str], str]:
    """The failing test ids (and pytest's tail); a collection error counts as a failure of its file.
    ``first``: stop at the first failure (a mutation needs one; the unmutated run needs them all)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]),
               PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=no", "-rfE", *(["-x"] if first else []),
           *(f"--deselect={d}" for d in sorted(deselect)), *tests]
    try:
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"<timeout>"}, f"ran past {timeout_s:.0f} s"
    out = proc.stdout + proc.stderr
    failed = set(re.findall(r"^(?:FAILED|ERROR) (\S+)", out, flags=re.M))
    if proc.returncode not in (0, 1, 5) and not failed:  # interrupted, internal or usage error
        failed = {f"<pytest exit {proc.returncode}>"}
    return failed, out[-1500:]


def present(tree: Path, test: str) -> bool:
    """Whether this checkout has the test file (and the test function a node id names)."""
    path, _, name = test.partition("::")
    return (tree / path).is_file() and (not name or f"def {name.split('[')[0]}(" in (tree / path).read_text())


def copy_tree(source: Path, into: Path) -> Path:
    ignore = shutil.ignore_patterns(".git", "out", "__pycache__", ".venv*", "*.egg-info", ".pytest_cache",
                                    ".ruff_cache")
    target = into / "tree"
    shutil.copytree(source, target, ignore=ignore, symlinks=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, default=REPO, help="checkout whose package and tests are used")
    parser.add_argument("--only", default="", help="comma-separated mutation names (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--tests", default="", help="comma-separated tests to run instead of each mutation's own "
                        "(does this file alone catch it?)")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per pytest run")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only.split(",")]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.what} ({m.path}); tests: {', '.join(m.tests)}")
        return 0
    results = {}
    with tempfile.TemporaryDirectory(prefix="envpipe-mutations-") as tmp:
        tree = copy_tree(args.tree.resolve(), Path(tmp))
        checked: dict[str, bool] = {}  # test id -> fails unmutated too
        for m in chosen:
            tests = [t for t in (args.tests.split(",") if args.tests else m.tests) if present(tree, t)]
            start = time.monotonic()
            if not tests:
                results[m.name] = {"result": "n/a", "why": "none of its tests is in this checkout", "tests": []}
            elif (planted := apply(tree, m)) is None:
                where = " or ".join(p for p, _, _ in m.places())
                results[m.name] = {"result": "n/a", "why": f"snippet not found once in {where}", "tests": tests}
            else:
                mutated, original = planted
                try:
                    known: set[str] = set()  # tests that fail unmutated too: run without them
                    while True:
                        failed, tail = failed_tests(tree, tests, known, args.timeout)
                        ids = {t for t in failed if not t.startswith("<")}
                        new = sorted(t for t in ids if t not in checked)
                        if new:  # a failure counts when the test passes unmutated: run just those, unmutated
                            mutated.write_text(original)
                            already, _ = failed_tests(tree, new, set(), args.timeout, first=False)
                            apply(tree, m)
                            checked.update({t: t in already for t in new})
                        real = (failed - ids) | {t for t in ids if not checked[t]}
                        if real or not ids:
                            failed = real
                            break
                        known |= ids
                finally:
                    mutated.write_text(original)
                results[m.name] = {"result": "caught" if failed else "MISSED", "by": sorted(failed), "tests": tests,
                                   "file": str(mutated.relative_to(tree)),
                                   "failing_unmutated": sorted(known), **({} if failed else {"tail": tail})}
            results[m.name]["seconds"] = round(time.monotonic() - start, 1)
            print(f"{m.name:32} {results[m.name]['result']:7} {', '.join(results[m.name].get('by', []))[:150]}",
                  flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    missed = [name for name, r in results.items() if r["result"] == "MISSED"]
    print(f"{len(results) - len(missed)} of {len(results)} caught or n/a; missed: {', '.join(missed) or 'none'}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
