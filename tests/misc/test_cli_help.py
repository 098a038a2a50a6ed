"""``forge-dist --help`` and ``forge-dist demo --help`` read as plain text and document every
option a user can pass."""
import pytest

from forge_dist import cli


def test_top_level_help_is_plain_text(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: forge-dist {demo,info,compile}")
    for command in ("demo", "info", "compile"):
        assert f"\n  {command} " in out
    assert "`" not in out and ":func:" not in out


def test_no_command_prints_usage_and_fails(capsys):
    assert cli.main([]) == 2
    assert capsys.readouterr().out.startswith("usage: forge-dist")


def test_demo_help_documents_every_option(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["demo", "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    for option, words in (("--ops", "ops to check"), ("--strategies", "strategies to check"),
                          ("--dtypes", "float64 and/or float32"), ("--world", "ranks"),
                          ("--cpu", "gloo")):
        assert option in out and words in out, option
    assert "`" not in out


def test_info_reports_the_node_and_autos_pick_for_the_jobs_layout(capsys, monkeypatch):
    """``forge-dist info`` says which node this process is on and what ``auto`` picks for the
    job the launcher describes (the scaling issue: its choice is reported)."""
    from forge_dist import cli

    for key in ("FORGE_DIST_NODE", "FORGE_DIST_RANKS_PER_NODE", "GROUP_RANK", "SLURM_NODEID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "9")
    assert cli.info([]) == 0
    out = capsys.readouterr().out
    assert "node of this process (hier, auto): 1" in out
    line = next(ln for ln in out.splitlines() if ln.startswith("auto on CUDA, 16 ranks"))
    # (the model's pick for 2 nodes of 8: scan, whose 4 rounds beat hier's 5 once each
    # further round waits for its partner)
    assert "scalar scan (" in line and "dense " in line
