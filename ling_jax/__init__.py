"""ling-jax: Ling-3.0 (KDA + MLA hybrid MoE) inference in JAX/Pallas. `load` gives a checkpoint's Flax NNX model."""


def load(checkpoint_or_hf_dir, **kw):
    """`ling_jax.flax_model.load`: a ling-jax or HF checkpoint as a `LingForCausalLM` (mesh=... reads it sharded)."""
    from ling_jax.flax_model import load as load_model  # flax is imported only by those who ask for the module

    return load_model(checkpoint_or_hf_dir, **kw)
