"""Where a series changes level: the one split into a before and an after whose values' squared
deviations from their own means sum least (a single change point found by least squares). An onset
read off a series this way moves with the data, not with a threshold: a noisy value or two before the
change shifts it only where they are closer to the after's level than to the before's."""

import numpy as np


def change_point(values: np.ndarray) -> int:
    """The position the after begins at (1 .. len - 1); 0 for fewer than two values."""
    n = len(values)
    if n < 2:
        return 0
    values = np.asarray(values, dtype=float)
    k = np.arange(1, n)  # the after begins at position k
    total, squares = np.cumsum(values), np.cumsum(values**2)
    before = squares[k - 1] - total[k - 1] ** 2 / k
    after = (squares[-1] - squares[k - 1]) - (total[-1] - total[k - 1]) ** 2 / (n - k)
    return int(k[np.argmin(before + after)])
