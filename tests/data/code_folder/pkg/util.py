def clamp(value, low, high):
    """Clamp value to [low, high]."""
    if value < low:
        return low
    if value > high:
        return high
    return value


def mean(values):
    return sum(values) / len(values)
