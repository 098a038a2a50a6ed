import pytest

from forge_dist.config import ConfigError, load

DEFAULTS = {"B": 4, "ops": ["gla"], "model": {"layers": 2, "name": "x"}}


def test_file_and_overrides(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('B = 2\n[model]\nlayers = 6\n')
    cfg = load(DEFAULTS, str(f), ["model.name=gdn", "ops=['gla', 'hgrn']"])
    assert cfg == {"B": 2, "ops": ["gla", "hgrn"], "model": {"layers": 6, "name": "gdn"}}
    assert DEFAULTS["B"] == 4  # defaults untouched


@pytest.mark.parametrize("overrides,words", [
    (["C=1"], "unknown key 'C'"), (["model.depth=1"], "unknown key 'depth'"),
    (["B"], "expected key=value"), (["model=3"], "must be a table")])
def test_bad_overrides(overrides, words):
    with pytest.raises(ConfigError, match=words):
        load(DEFAULTS, None, overrides)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load(DEFAULTS, str(tmp_path / "missing.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("B = = 2")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load(DEFAULTS, str(bad))
