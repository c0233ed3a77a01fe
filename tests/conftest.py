"""Suite-wide setup: 4 host devices for the sharding tests (must precede JAX's backend start), float32 math."""

import jax

jax.config.update("jax_num_cpu_devices", 4)
