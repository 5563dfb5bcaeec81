"""Learning-rate grids the tuner searches (log grids, as the paper tunes every method)."""

import numpy as np

FIRST_ORDER_LR = tuple(float(x) for x in np.round(10.0 ** np.arange(-2.0, 3.01, 0.5), 6))  # 0.01 .. 1000
SECOND_ORDER_LR = (1.0, 0.5, 0.25, 0.125)  # Newton-type steps: the unit step is the natural largest
