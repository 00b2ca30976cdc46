"""docs/flags.md states the defaults a run uses: every default its flag table names (`(default 300)`,
`default 1 %`, `` `exact` (default) ``) and its intro's "The defaults (`baseline`, `1f1b`, `default`)" equal
EnvPipeConfig's (which add_envpipe_args hands to argparse). A default changed in code but not in the docs
(or the reverse) fails here; bench/mutations.py's bug 10 (`--envpipe-comm-timeout` 300 s -> 30 s) is one.
In-process, reads one file: fast tier.
"""

from __future__ import annotations

import re
from pathlib import Path

from megatron_envpipe.config import EnvPipeConfig
from megatron_envpipe.config.flag_table import FIELDS

DOC = Path(__file__).resolve().parents[2] / "docs" / "flags.md"
# "default 300", "default `on`", "default 1 %", "(default `0.02`)"; and "`exact` (default)", "`auto` (default: ...)"
AFTER = re.compile(r"default (`?)([\w.\-]+)\1( ?%)?")
BEFORE = re.compile(r"`([\w.\-]+)` \(default[):]")
# flag -> (what the doc says, why the setting differs and is still right)
DIFFERENT = {
    "--envpipe-gpu": ("auto", "EnvPipeConfig.gpu None is auto: the device is chosen at start-up"),
    "--envpipe-sim-straggler": ("0", "the 0 is ITER's default inside REPLICA:FACTOR[@ITER]; no straggler by default"),
}


def documented_defaults(text: str) -> dict[str, str]:
    """flag -> the default its row states, for rows of the flag table that name one flag and one default
    (a row naming several flags cannot say whose default it states); a percentage as a fraction."""
    table = text.split("## When a flag acts")[0]
    found: dict[str, str] = {}
    for line in table.splitlines():
        cells = line.split(" | ")
        if not line.startswith("| `--") or len(cells) < 2:
            continue
        flags = re.findall(r"`(--[\w-]+)", cells[0])
        stated = [(v, pct) for _, v, pct in AFTER.findall(cells[1])] + [(v, "") for v in BEFORE.findall(cells[1])]
        if len(flags) == 1 and len(stated) == 1:
            value, pct = stated[0]
            found[flags[0]] = str(float(value) / 100) if pct else value
    return found


def mismatches(found: dict[str, str]) -> list[str]:
    config = EnvPipeConfig()
    by_flag = {f.flag: f for f in FIELDS}
    wrong = []
    for flag, doc in found.items():
        if flag in DIFFERENT:
            continue
        actual = getattr(config, by_flag[flag].name)
        if isinstance(actual, bool) or not isinstance(actual, int | float):
            same = str(actual) == doc
        else:
            try:
                same = float(doc) == float(actual)
            except ValueError:
                same = False
        if not same:
            wrong.append(f"{flag}: docs/flags.md says default {doc}, EnvPipeConfig has {actual!r}")
    return wrong


def test_the_flag_table_states_the_defaults_a_run_uses():
    found = documented_defaults(DOC.read_text())
    # the scan reads what the table states (a table reworded so that nothing matches would pass vacuously)
    assert len(found) >= 12 and found["--envpipe-comm-timeout"] == "300", found
    assert found["--envpipe-timing-margin"] == "0.01" and found["--envpipe-sim-dynamics"] == "exact", found
    assert mismatches(found) == []
    for flag, (doc, _why) in DIFFERENT.items():  # an exception that no longer applies is removed
        assert found.get(flag) == doc, f"{flag}: docs/flags.md no longer says default {doc}; drop it from DIFFERENT"


def test_the_intro_names_the_plan_type_scheduling_and_reconfig_defaults():
    stated = re.search(r"The defaults \(`(\w+)`, `(\w+)`, `(\w+)`\)", DOC.read_text())
    assert stated, "docs/flags.md's intro no longer names the defaults of --envpipe-type/-scheduling/-reconfig"
    config = EnvPipeConfig()
    assert stated.groups() == (str(config.plan_type), str(config.scheduling), str(config.reconfig))


def test_a_default_the_code_does_not_use_is_reported():
    config = EnvPipeConfig()
    row = "| `--envpipe-comm-timeout S` | a transfer stuck this long raises ... (default 12345) |\n"
    assert documented_defaults(row) == {"--envpipe-comm-timeout": "12345"}
    assert mismatches(documented_defaults(row)) == [
        f"--envpipe-comm-timeout: docs/flags.md says default 12345, EnvPipeConfig has {config.comm_timeout_s!r}"]
    pct = "| `--envpipe-timing-margin X` | slack (`0.01` or `1%`, default 7 %; `0`: none) |\n"
    assert mismatches(documented_defaults(pct)) == [
        f"--envpipe-timing-margin: docs/flags.md says default 0.07, EnvPipeConfig has {config.timing_margin!r}"]
    word = "| `--envpipe-clock-lead on|off` | request each raise ahead; default `off`, see ... |\n"
    assert mismatches(documented_defaults(word)) == [
        f"--envpipe-clock-lead: docs/flags.md says default off, EnvPipeConfig has {config.clock_lead!r}"]
