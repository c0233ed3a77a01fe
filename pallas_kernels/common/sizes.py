"""Power-of-two helpers: the Triton lowering takes only power-of-two block shapes."""


def is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def check_pow2_fields(obj, names, minimum: int = 1) -> None:
    """Raise naming the field when a tuning field is not a power of two >= minimum."""
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, int) or v < minimum or not is_pow2(v):
            bound = f" >= {minimum}" if minimum > 1 else ""
            raise ValueError(f"{type(obj).__name__}.{name}={v} must be a power of two{bound}")
