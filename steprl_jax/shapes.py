"""The sizes compiled programs are made for: every jitted program is compiled once per shape,
so a size that varies from call to call (rows, tokens, cache slots, gathered key blocks) is
rounded up to a few values."""


def bucket(n: int, minimum: int = 1, multiple: int = 1) -> int:
    """Smallest value >= n of the form 2^k or 3 * 2^(k-1), at least `minimum`, rounded up to
    a multiple of `multiple`: at most 1.5x padding and two programs per octave."""
    n = max(int(n), int(minimum), 1)
    p = 1 << (n - 1).bit_length()  # next power of two
    b = p if p == 1 or 3 * p // 4 < n else 3 * p // 4
    return -(-b // multiple) * multiple
