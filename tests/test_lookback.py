import numpy as np
import pytest

from halwatch.signals.lookback import lookback_ratios


def test_lookback_ratio_on_a_hand_built_matrix():
    # 3 prompt tokens, 2 response tokens, one head
    rows = np.array([[[0.2, 0.2, 0.2, 0.4, 0.0],     # response token 0: context mean 0.2, own 0.4
                      [0.1, 0.1, 0.4, 0.3, 0.1]]])   # response token 1: context mean 0.2, generated mean 0.2
    ratios = lookback_ratios(rows, n_prompt=3)
    np.testing.assert_allclose(ratios, [[0.2 / (0.2 + 0.4), 0.2 / (0.2 + 0.2)]])


def test_lookback_ratio_extremes_and_errors():
    only_context = np.array([[[0.5, 0.5, 0.0]]])
    only_self = np.array([[[0.0, 0.0, 1.0]]])
    assert lookback_ratios(only_context, 2)[0, 0] == 1.0
    assert lookback_ratios(only_self, 2)[0, 0] == 0.0
    with pytest.raises(ValueError):
        lookback_ratios(only_self, 1)
