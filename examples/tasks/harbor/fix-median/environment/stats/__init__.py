from stats.core import mean, median
