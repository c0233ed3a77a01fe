"""Power-of-two helpers: the Triton lowering takes only power-of-two block shapes."""


def is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
