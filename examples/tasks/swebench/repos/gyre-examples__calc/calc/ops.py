def add(a, b):
    return a + b


def mul(a, b):
    return a * b


def div(a, b):
    return a / b


def power(base, exp):
    result = 1
    for _ in range(exp):
        result *= base
    return result


def mean(values):
    return sum(values) / len(values)
