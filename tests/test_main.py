import pytest

from gpytorch_decoupled.__main__ import main


@pytest.mark.parametrize("argv", [["--help"], ["demo", "--help"], ["datasets", "--help"]])
def test_help_everywhere(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 0
    assert "usage" in capsys.readouterr().out


def test_datasets_listing(capsys):
    main(["datasets"])
    out = capsys.readouterr().out
    assert "elevators" in out and "kin40k" in out
