"""The benchmark's arguments and report shape (speed itself is never asserted here)."""

import pytest

from keras_distrib.commands import bench


def test_bad_arguments_are_refused(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--steps", "0", "--repeats", "0"])
    error = capsys.readouterr().err
    assert "`--steps`=0 must be >= 1" in error and "`--repeats`=0 must be >= 1" in error
    with pytest.raises(SystemExit):
        bench.main(["--variants", "kd_fit_mirrored,no_such"])
    assert "`--variants` names unknown variant(s) ['no_such']" in capsys.readouterr().err


def test_every_ratio_and_target_names_measured_variants():
    for numerator, denominator in bench.RATIOS.values():
        assert numerator in bench.VARIANTS and denominator in bench.VARIANTS
    assert set(bench.TARGETS) <= set(bench.RATIOS)
    for comparison, bound in bench.TARGETS.values():
        assert comparison in (">=", "<=") and bound > 0
