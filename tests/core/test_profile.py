"""Profiles: the Perseus CSV format, validation with file:line, Pareto, scaling."""

from __future__ import annotations

import pytest

from megatron_envpipe.core.profile import Profile, ProfileError, ProfilePoint

GOOD = """stage,instruction,frequency,time,energy
0,forward,1410,0.10,30.0
0,backward,1410,0.20,60.0
0,forward,1200,0.12,25.0
0,backward,1200,0.24,50.0
1,forward,1410,0.11,31.0
1,backward,1410,0.21,61.0
1,forward,1200,0.13,26.0
1,backward,1200,0.25,51.0
"""


def write(tmp_path, text, name="p.csv"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_shipped_profiles_load(gpt3_profile, bloom_profile):
    for prof in (gpt3_profile, bloom_profile):
        assert prof.num_stages == 8
        assert prof.max_frequency() == 1740
        assert len(prof.common_frequencies()) == 60
        assert prof.common_frequencies()[-1] == 855
        # SOURCES.md: emulation inputs, stages 0-6 identical row for row; stage 7 differs.
        for s in range(1, 7):
            assert prof.points(s, "forward") == prof.points(0, "forward")
        assert prof.points(7, "backward") != prof.points(0, "backward")
    assert gpt3_profile.time_s(0, "forward", 1740) == pytest.approx(0.11248032760620108)


def test_roundtrip(tmp_path, gpt3_profile):
    out = tmp_path / "sub" / "copy.csv"
    gpt3_profile.to_csv(out)
    again = Profile.from_csv(out)
    for s in range(8):
        for ins in ("forward", "backward"):
            assert again.points(s, ins) == gpt3_profile.points(s, ins)
    assert not list(out.parent.glob(".copy.csv.*")), "temp file left behind"


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (lambda t: t.replace("stage,instruction", "stg,instruction"), r"p\.csv:1: header lacks column\(s\) stage"),
        (lambda t: t.replace("0,forward,1200,0.12,25.0", "0,forward,1200,abc,25.0"), r"p\.csv:4: time 'abc' is not a number"),
        (lambda t: t.replace("0,forward,1200,0.12,25.0", "0,forward,1200,-0.12,25.0"), r"p\.csv:4: time must be > 0"),
        (lambda t: t.replace("0,forward,1200,0.12,25.0", "0,forward,1200,0.12,-1"), r"p\.csv:4: energy must be >= 0"),
        (lambda t: t.replace("0,forward,1200,0.12,25.0", "0,forward,1200,0.12,nan"), r"p\.csv:4: energy 'nan' is not finite"),
        (lambda t: t.replace("0,forward,1200,0.12,25.0", "0,forward,,0.12,25.0"), r"p\.csv:4: missing frequency"),
        (lambda t: t.replace("0,forward,1200,0.12,25.0", "0,forward,1200.5,0.12,25.0"), r"p\.csv:4: frequency .* whole number"),
        (lambda t: t.replace("0,forward,1200,0.12,25.0", "0,sideways,1200,0.12,25.0"), r"p\.csv:4: instruction 'sideways'"),
        (lambda t: t.replace("0,forward,1200,0.12,25.0", "0,forward,1200,0.12"), r"p\.csv:4: 4 fields where the header"),
        (lambda t: t + "1,backward,1200,0.25,51.0\n", r"p\.csv:10: duplicate row for stage 1 backward at 1200 MHz \(first at line 9\)"),
        (lambda t: t.replace("1,", "2,"), r"stage\(s\) \[1\] missing"),
        (lambda t: "\n".join(line for line in t.splitlines() if "1,backward" not in line), r"stage 1 has no backward rows"),
        (lambda t: "", r"empty profile"),
        (lambda t: t.splitlines()[0] + "\n", r"header but no rows"),
    ],
)
def test_corrupt_profiles_name_file_and_line(tmp_path, mutate, needle):
    path = write(tmp_path, mutate(GOOD))
    with pytest.raises(ProfileError, match=needle):
        Profile.from_csv(path)


def test_missing_file_is_clear(tmp_path):
    with pytest.raises(ProfileError, match=r"nope\.csv: cannot read profile"):
        Profile.from_csv(tmp_path / "nope.csv")


def test_rank_columns_aggregate_tp_ranks(tmp_path):
    text = "rank,dp_rank,pp_rank,tp_rank,stage,instruction,frequency,time,energy\n"
    for tp, (t, e) in enumerate([(0.10, 30.0), (0.12, 34.0)]):
        text += f"{tp},0,0,{tp},0,forward,1410,{t},{e}\n{tp},0,0,{tp},0,backward,1410,{2 * t},{2 * e}\n"
    prof = Profile.from_csv(write(tmp_path, text))
    # Max time over the TP group, mean energy per GPU.
    assert prof.time_s(0, "forward", 1410) == pytest.approx(0.12)
    assert prof.energy_j(0, "forward", 1410) == pytest.approx(32.0)


def test_unprofiled_clock_error_lists_clocks(tmp_path):
    prof = Profile.from_csv(write(tmp_path, GOOD))
    with pytest.raises(ProfileError, match="not profiled at 1300 MHz; profiled clocks: 2 clocks, 1200..1410"):
        prof.time_s(0, "forward", 1300)


def test_valley_is_the_faster_of_equal_energies():
    pts = [
        ProfilePoint(1500, 1.0, 10.0),
        ProfilePoint(1400, 1.1, 9.0),
        ProfilePoint(1300, 1.2, 9.5),  # slower and hungrier than 1400: dominated
        ProfilePoint(1200, 1.3, 8.0),
        ProfilePoint(1100, 1.5, 8.0),  # as cheap as 1200 but slower: dominated
    ]
    prof = Profile({(0, "forward"): pts, (0, "backward"): pts})
    assert prof.min_energy_frequency(0, "forward") == 1200  # tie with 1100 -> the faster clock


def test_scaled(tmp_path):
    prof = Profile.from_csv(write(tmp_path, GOOD)).scaled(10, 80)
    assert prof.time_s(1, "backward", 1200) == pytest.approx(2.5)
    assert prof.energy_j(1, "backward", 1200) == pytest.approx(51.0 * 80)
    with pytest.raises(ProfileError, match="positive"):
        prof.scaled(0, 1)


def test_for_pipeline_keeps_the_last_stage(gpt3_profile):
    four = gpt3_profile.for_pipeline(4)
    assert four.num_stages == 4
    assert four.points(3, "backward") == gpt3_profile.points(7, "backward")
    assert four.points(1, "forward") == gpt3_profile.points(1, "forward")
    assert gpt3_profile.for_pipeline(8) is gpt3_profile
    with pytest.raises(ProfileError, match="cannot emulate 9 stages"):
        gpt3_profile.for_pipeline(9)


@pytest.mark.parametrize("scales", [(float("nan"), 1.0), (1.0, float("inf")), (0.0, 1.0), (1.0, -80.0)])
def test_scaled_rejects_non_finite_or_non_positive_scales(gpt3_profile, scales):
    with pytest.raises(ProfileError, match="scales must be positive and finite"):
        gpt3_profile.scaled(*scales)


def test_non_finite_points_are_rejected_however_built():
    pts = {(0, "forward"): [ProfilePoint(1500, float("nan"), 1.0)], (0, "backward"): [ProfilePoint(1500, 0.1, 1.0)]}
    with pytest.raises(ProfileError, match="stage 0 forward at 1500 MHz has time nan s"):
        Profile(pts, source="<test>")


def test_undecodable_profile_names_file_and_line(tmp_path):
    path = tmp_path / "p.csv"
    path.write_bytes(b"stage,instruction,frequency,time,energy\n0,forward,1500,0.1,\xff\n")
    with pytest.raises(ProfileError, match=r"p.csv:2: not UTF-8 text \(byte 0xff"):
        Profile.from_csv(path)


def test_byte_order_mark_is_accepted(tmp_path, gpt3_profile):
    path = tmp_path / "p.csv"
    path.write_bytes(b"\xef\xbb\xbf" + gpt3_profile.to_csv_text().encode())
    assert Profile.from_csv(path).num_stages == gpt3_profile.num_stages


def test_a_huge_stage_id_does_not_enumerate_every_gap():
    pts = {(s, ins): [ProfilePoint(1500, 0.1, 1.0)] for s in (0, 10**9) for ins in ("forward", "backward")}
    with pytest.raises(ProfileError, match=r"stage\(s\) \[1, 2, 3, 4, 5\] \.\.\. missing"):
        Profile(pts)


# -- model chunks -------------------------------------------------------------------------

CHUNKED = """stage,instruction,frequency,time,energy,chunk
0,forward,1410,0.05,15.0,0
0,backward,1410,0.10,30.0,0
0,forward,1410,0.06,16.0,1
0,backward,1410,0.11,31.0,1
1,forward,1410,0.07,17.0,0
1,backward,1410,0.12,32.0,0
1,forward,1410,0.08,18.0,1
1,backward,1410,0.13,33.0,1
0,forward,1200,0.06,14.0,0
0,backward,1200,0.12,28.0,0
0,forward,1200,0.07,15.0,1
0,backward,1200,0.13,29.0,1
1,forward,1200,0.08,16.0,0
1,backward,1200,0.14,31.0,0
1,forward,1200,0.09,17.0,1
1,backward,1200,0.15,32.0,1
"""


def test_chunk_column_parses_per_chunk(tmp_path):
    prof = Profile.from_csv(write(tmp_path, CHUNKED))
    assert (prof.num_stages, prof.num_chunks) == (2, 2)
    assert prof.time_s(1, "forward", 1410, chunk=1) == 0.08
    assert prof.energy_j(0, "backward", 1200, 1) == 29.0
    assert prof.point(1, "backward", 1200, chunk=0) == ProfilePoint(1200, 0.14, 31.0)
    assert prof.frequencies(0, "forward", 1) == (1410, 1200)
    assert [p.time_s for p in prof.points(1, "backward", 1)] == [0.13, 0.15]
    assert prof.min_energy_frequency(0, "forward", 1) == 1200
    # The default chunk is 0.
    assert prof.time_s(1, "forward", 1410) == 0.07
    with pytest.raises(ProfileError, match="no rows for stage 1 chunk 2 forward"):
        prof.points(1, "forward", 2)


def test_chunked_profile_roundtrips_and_one_chunk_output_is_unchanged(tmp_path, gpt3_profile):
    prof = Profile.from_csv(write(tmp_path, CHUNKED))
    text = prof.to_csv_text()
    assert text.splitlines()[0] == "stage,instruction,frequency,time,energy,chunk"
    again = Profile.from_csv_text(text)
    for s in range(2):
        for c in range(2):
            for ins in ("forward", "backward"):
                assert again.points(s, ins, c) == prof.points(s, ins, c)
    assert gpt3_profile.to_csv_text().splitlines()[0] == "stage,instruction,frequency,time,energy"
    assert prof.scaled(2.0).time_s(1, "forward", 1410, 1) == pytest.approx(0.16)
    assert prof.for_pipeline(2) is prof and prof.restricted([1200]).frequencies(1, "backward", 1) == (1200,)


@pytest.mark.parametrize(
    "mutate,needle",
    [
        (lambda t: t.replace("1,forward,1410,0.08,18.0,1", "1,forward,1410,0.08,18.0,"), r"p.csv:8: missing chunk"),
        (lambda t: t.replace("1,forward,1410,0.08,18.0,1", "1,forward,1410,0.08,18.0,-1"), r"p.csv:8: chunk -1 is not"),
        (lambda t: t.replace("1,forward,1410,0.08,18.0,1", "1,forward,1410,0.08,18.0,1.5"), "p.csv:8: chunk '1.5'"),
        (lambda t: t.replace("1,forward,1410,0.08,18.0,1", "1,forward,1410,0.08,18.0,0"), "p.csv:8: duplicate row for "
         "stage 1 chunk 0 forward"),
    ],
)
def test_bad_chunk_columns_name_file_and_line(tmp_path, mutate, needle):
    with pytest.raises(ProfileError, match=needle):
        Profile.from_csv(write(tmp_path, mutate(CHUNKED)))


def test_every_stage_needs_every_chunk(tmp_path):
    text = "".join(line + "\n" for line in CHUNKED.splitlines() if not line.startswith("1,") or not line.endswith(",1"))
    with pytest.raises(ProfileError, match=r"stage 1 chunk 1 has no forward rows \(every stage needs chunks 0..1\)"):
        Profile.from_csv(write(tmp_path, text))


def test_for_chunks_splits_a_whole_stage_profile_evenly(gpt3_profile):
    prof = gpt3_profile.for_chunks(4)
    assert (prof.num_stages, prof.num_chunks) == (8, 4)
    for s in (0, 7):
        for ins in ("forward", "backward"):
            whole = gpt3_profile.points(s, ins)
            for c in range(4):
                assert prof.points(s, ins, c) == tuple(
                    ProfilePoint(p.freq_mhz, p.time_s / 4, p.energy_j / 4) for p in whole
                )
    assert "split into 4 equal chunks" in prof.source
    assert gpt3_profile.for_chunks(1) is gpt3_profile
    assert prof.for_chunks(4) is prof


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, 10**6])
def test_for_chunks_rejects_bad_counts(gpt3_profile, bad):
    with pytest.raises(ProfileError, match="model chunks per stage must be a whole number"):
        gpt3_profile.for_chunks(bad)


def test_for_chunks_refuses_another_chunk_count(tmp_path):
    prof = Profile.from_csv(write(tmp_path, CHUNKED))
    with pytest.raises(ProfileError, match="profiled with 2 model chunks per stage but the pipeline has 4"):
        prof.for_chunks(4)
    with pytest.raises(ProfileError, match="profiled with 2 model chunks per stage but the pipeline has 1"):
        prof.for_chunks(1)


def test_constructor_takes_chunk_keys_and_rejects_a_key_given_twice():
    pt = [ProfilePoint(1000, 1.0, 1.0)]
    prof = Profile({(0, "forward", 1): pt, (0, "backward", 1): pt, (0, "forward"): pt, (0, "backward", 0): pt})
    assert prof.num_chunks == 2
    with pytest.raises(ProfileError, match="given twice"):
        Profile({(0, "forward"): pt, (0, "forward", 0): pt, (0, "backward"): pt})
