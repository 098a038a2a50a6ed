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
