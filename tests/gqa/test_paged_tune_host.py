"""tools/paged_tune.py's config names on the CPU: ``NAME``, ``tiling=W,T,S`` and either with ``:sN``
(a forced split count), and the e4m3 option (the tool itself needs a GPU)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "paged_tune.py"


@pytest.fixture(scope="module")
def tune():
    spec = importlib.util.spec_from_file_location("paged_tune_tool", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_config_names_with_and_without_a_split_count(tune):
    assert tune._config("default") == ({}, None, False, None)
    assert tune._config("det:s4") == ({}, None, True, 4)
    assert tune._config("tiling=4,32,3") == ({"GQADRV_TILING": "4,32,3"}, "hopper", False, None)
    assert tune._config("tiling=4,32,3:s2") == ({"GQADRV_TILING": "4,32,3"}, "hopper", False, 2)


@pytest.mark.parametrize("name", ["bogus", "default:", "default:x2", "default:s", "tiling=4,32", "tiling=4,32,3:2"])
def test_unknown_config_names_are_rejected(tune, name):
    assert tune._config(name) is None


def test_the_command_line_rejects_an_unknown_config_and_knows_e4m3(tune, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["paged_tune.py", "--configs", "tiling=4,32,3:s2", "nope"])
    with pytest.raises(SystemExit) as exc:
        tune.main()
    assert exc.value.code == 2 and "unknown config 'nope'" in capsys.readouterr().err
    monkeypatch.setattr("sys.argv", ["paged_tune.py", "--kv-dtype", "e5m2"])
    with pytest.raises(SystemExit):
        tune.main()
    assert "invalid choice" in capsys.readouterr().err
