"""The end of a run's one line (explain/summary.py): what the end-of-run probes added to it, from a second up."""

from profiles import make_profile, write

from dtrain.explain.summary import probes_note

STEP = [{"data": 0.001, "forward": 0.004, "backward": 0.004, "optimizer": 0.001}]


def test_the_probes_time_is_named_from_a_second_with_how_to_skip_them(tmp_path):
    assert probes_note(tmp_path) == ""  # no profile (profiling off)
    for seconds, said in ((None, False), (0.4, False), (12.2, True)):
        write(tmp_path, make_profile(STEP, probe_seconds=seconds))
        note = probes_note(tmp_path)
        assert bool(note) == said, (seconds, note)
        if said:
            assert note.startswith("; end-of-run probes 12.2s") and "profiling.probes: false" in note, note
