"""Token selection strategies: frozen dataclasses (static under jit).

Each sampler draws from the distribution its `log_probs` returns, so speculative acceptance (engine.acceptance) can
test drafts against exactly what plain decoding would have sampled.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Greedy:
    def log_probs(self, logits: jax.Array) -> jax.Array:
        """logits [..., V] -> float32 [..., V]: 0 at the argmax (lowest id on ties, as torch.argmax), -inf elsewhere."""
        top = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.bool_)
        return jnp.where(top, 0.0, -jnp.inf).astype(jnp.float32)

    def sample(self, logits: jax.Array, key: jax.Array) -> jax.Array:
        """logits [..., V] -> [...] int32, the argmax."""
        del key
        return jnp.argmax(self.log_probs(logits), axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class TopP:
    """Temperature sampling restricted to the smallest set of tokens whose probability reaches `top_p`."""

    temperature: float = 1.0
    top_p: float = 1.0

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (use Greedy for argmax decoding)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must lie in (0, 1]")

    def log_probs(self, logits: jax.Array) -> jax.Array:
        """logits [..., V] -> float32 [..., V]: log softmax(logits / temperature) over the top-p set, -inf outside."""
        logits = logits.astype(jnp.float32) / self.temperature
        if self.top_p < 1.0:
            sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
            probs = jax.nn.softmax(sorted_logits, axis=-1)
            # Keep a token while the mass strictly before it is < top_p, so the top token always survives.
            mass_before = jnp.cumsum(probs, axis=-1) - probs
            kept = jnp.where(mass_before < self.top_p, sorted_logits, jnp.inf)
            threshold = jnp.min(kept, axis=-1, keepdims=True)
            logits = jnp.where(logits >= threshold, logits, -jnp.inf)
        return jax.nn.log_softmax(logits, axis=-1)

    def sample(self, logits: jax.Array, key: jax.Array) -> jax.Array:
        """logits [..., V] -> [...] int32, one independent draw per row."""
        return jax.random.categorical(key, self.log_probs(logits), axis=-1).astype(jnp.int32)


def make_sampler(temperature: float = 0.0, top_p: float = 1.0):
    """temperature 0 -> Greedy; otherwise TopP."""
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    if temperature == 0:
        if top_p != 1.0:
            raise ValueError(f"top_p={top_p} has no effect with temperature 0 (greedy); drop it or set a temperature")
        return Greedy()
    return TopP(temperature, top_p)
