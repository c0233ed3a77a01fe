"""The converted weights as a Flax NNX model: `LingForCausalLM`, a module over the one functional core.

Its variables are the leaves of the params pytree (`params.param_specs`), each an `nnx.Param` carrying that
leaf's logical axes as `out_sharding` metadata. Nothing is declared twice and nothing is computed twice: the methods call
`ling_jax.model` and `ling_jax.engine` on `model.params`, which hands the variables' arrays back as the params
pytree without copying them.

    model = LingForCausalLM(cfg, rngs=nnx.Rngs(0))             # random weights (mesh=...: drawn into their shards)
    model = LingForCausalLM(cfg, params)                       # wraps existing params, no copy
    model = ling_jax.load(checkpoint_or_hf_dir, mesh=mesh)     # a checkpoint, read into its shards
    graphdef, state = nnx.split(model)                         # state_to_params(cfg, state) is model.params

The state's paths are the params' paths (`layers.3.mixer.w_in.q`; the MTP layer's under `nextn`, as `mtp` is the
method running it), so a ling-jax orbax checkpoint holds the state: `save` writes it through `conversion.orbax_io.save_params`, and `load` restores it onto any mesh.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ling_jax import model as core
from ling_jax.config import LingConfig
from ling_jax.params import init_params, is_spec, param_specs
from ling_jax.sharding import logical_to_spec, param_shardings

# The params' top-level entries and the module attributes holding them: the MTP layer's weights sit under `nextn`
# (its HF name), since `mtp` is the module's method running that layer.
ATTRIBUTES = {"embed": "embed", "layers": "layers", "final_norm": "final_norm", "lm_head": "lm_head", "mtp": "nextn"}


class LingForCausalLM(nnx.Module):
    """Ling-3.0 (KDA + MLA hybrid MoE) as an NNX module; `cfg` is static, every weight an `nnx.Param`.

    Args:
      cfg: the model's config.
      params: a params pytree shaped like `param_specs(cfg)` (with or without its "mtp" entry) to wrap as it is;
        None draws random weights from `rngs`.
      rngs: `nnx.Rngs` for random weights (its `params` stream).
      dtype: compute dtype of random weights (fixed-dtype params keep theirs, `ParamSpec.dtype`).
      with_mtp: random weights include the MTP layer when the config has one.
      mesh: random weights drawn straight into `param_shardings(cfg, mesh)`.
    """

    def __init__(self, cfg: LingConfig, params: Any = None, *, rngs: nnx.Rngs | None = None, dtype=jnp.float32,
                 with_mtp: bool = True, mesh: jax.sharding.Mesh | None = None):
        if params is None:
            if rngs is None:
                raise ValueError("LingForCausalLM needs params to wrap, or rngs=nnx.Rngs(seed) to draw random weights")
            shardings = None if mesh is None else param_shardings(cfg, mesh, with_mtp=with_mtp)
            params = init_params(cfg, rngs.params(), dtype, with_mtp=with_mtp, shardings=shardings)
        specs = _specs_for(cfg, params)
        self.cfg = cfg
        for name, tree in jax.tree.map(_as_param, params, specs, is_leaf=is_spec).items():
            setattr(self, ATTRIBUTES[name], nnx.data(tree))

    @property
    def params(self) -> dict:
        """The params pytree of the functional core: the variables' own arrays (tracers under `nnx.jit`)."""
        return _values(self._variables())

    def as_params(self) -> dict:
        """`params`, under the name the engine and the model functions look for (`params.as_params`)."""
        return self.params

    def shardings(self, mesh: jax.sharding.Mesh) -> dict:
        """NamedShardings of the params pytree from each variable's logical axes (`sharding.RULES`)."""
        return jax.tree.map(lambda v: jax.sharding.NamedSharding(mesh, logical_to_spec(v.out_sharding)),
                            self._variables(), is_leaf=_is_variable)

    def _variables(self) -> dict:
        """The Params in the params pytree's structure."""
        return {name: getattr(self, attr) for name, attr in ATTRIBUTES.items() if hasattr(self, attr)}

    def prefill(self, tokens, *, max_len: int, backend: str = "reference", all_logits: bool = False,
                chunk: int | None = None):
        """`ling_jax.model.prefill` on this model's weights."""
        return core.prefill(self.params, tokens, self.cfg, max_len=max_len, backend=backend, all_logits=all_logits,
                            chunk=chunk)

    def decode(self, state, token, *, backend: str = "reference", checked: bool = False):
        """`ling_jax.model.decode` (`state` donated)."""
        return core.decode(self.params, state, token, self.cfg, backend=backend, checked=checked)

    def verify(self, state, tokens, *, backend: str = "reference", checked: bool = False):
        """`ling_jax.model.verify`."""
        return core.verify(self.params, state, tokens, self.cfg, backend=backend, checked=checked)

    def mtp(self, hidden, next_tokens, cache, start, *, mode: str, backend: str = "reference"):
        """`ling_jax.model.mtp_forward`, the NextN layer."""
        return core.mtp_forward(self.params, hidden, next_tokens, cache, start, self.cfg, mode=mode,
                                backend=backend)

    def generate(self, prompt, *, max_new_tokens: int, sampler=None, **kw):
        """`ling_jax.engine.generate.generate` (greedy by default); `kw` as that function's."""
        from ling_jax.engine.generate import generate
        from ling_jax.engine.sampling import Greedy

        return generate(self.params, self.cfg, prompt, max_new_tokens=max_new_tokens,
                        sampler=sampler if sampler is not None else Greedy(), **kw)

    def generate_speculative(self, prompt, *, max_new_tokens: int, drafter, k: int, sampler=None, **kw):
        """`ling_jax.engine.speculative.generate_speculative`; `kw` as that function's (aux, seed, backend, ...)."""
        from ling_jax.engine.sampling import Greedy
        from ling_jax.engine.speculative import generate_speculative

        return generate_speculative(self.params, self.cfg, prompt, max_new_tokens=max_new_tokens,
                                    sampler=sampler if sampler is not None else Greedy(), drafter=drafter, k=k,
                                    **kw)


def state_to_params(cfg: LingConfig, state: nnx.State) -> dict:
    """The params pytree of an `nnx.split` state: the same arrays, in the functional core's structure."""
    to_param = {attr: name for name, attr in ATTRIBUTES.items()}
    flat = {(to_param.get(path[0], path[0]),) + tuple(path[1:]): v for path, v in nnx.to_flat_state(state)}
    with_mtp = any(path[0] == "mtp" for path in flat)
    specs = param_specs(cfg, with_mtp=with_mtp)
    paths, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    keys = [tuple(_key(k) for k in path) for path, _ in paths]
    missing = [".".join(map(str, k)) for k in keys if k not in flat]
    extra = sorted(".".join(map(str, p)) for p in set(flat) - set(keys))
    if missing or extra:
        raise ValueError(f"the state does not hold the params of its config: missing {missing[:10]}, unexpected "
                         f"{extra[:10]}; split a LingForCausalLM built from this config")
    return jax.tree.unflatten(treedef, [_value(flat[k]) for k in keys])


def params_to_state(cfg: LingConfig, params: dict) -> nnx.State:
    """The `nnx.split` state of `LingForCausalLM(cfg, params)`: the same arrays as Params."""
    return nnx.state(LingForCausalLM(cfg, params))


def load(checkpoint_or_hf_dir: str | Path, *, mesh: jax.sharding.Mesh | None = None, dtype=None,
         with_mtp: bool = True, fp8: bool | None = None) -> LingForCausalLM:
    """A `LingForCausalLM` from a ling-jax (orbax) checkpoint or an HF safetensors directory.

    With `mesh`, every leaf is read straight into the shards `param_shardings(cfg, mesh)` gives (orbax reads each
    device's slice; the HF reader places each tensor as it goes), so the model is never whole on one device.
    `dtype` / `fp8` as in `conversion.load.load_hf` (fp8 applies to HF directories; an orbax checkpoint holds the
    format it was converted to).
    """
    from conversion.load import load_hf
    from conversion.orbax_io import is_hf_checkpoint, load_params, read_config
    from ling_jax.config import from_hf, read_config_json

    path = Path(checkpoint_or_hf_dir)
    if is_hf_checkpoint(path):
        cfg = from_hf(read_config_json(path))
        if fp8 is not None:
            cfg = cfg.replace(quantization="fp8" if fp8 else None)
        shardings = None if mesh is None else param_shardings(cfg, mesh, with_mtp=with_mtp)
        cfg, params = load_hf(path, dtype=dtype, shardings=shardings, with_mtp=with_mtp, fp8=fp8)
    else:
        if fp8 is not None:
            raise ValueError(f"fp8={fp8} applies to HF checkpoints; {path} is a ling-jax checkpoint, which holds the "
                             "format `ling-jax convert --dtype` gave it: convert the HF checkpoint again to change it")
        cfg = read_config(path)
        shardings = None if mesh is None else param_shardings(cfg, mesh)
        cfg, params = load_params(path, shardings=shardings, dtype=dtype)
    return LingForCausalLM(cfg, params)


def save(model: LingForCausalLM, path: str | Path, *, force: bool = False) -> Path:
    """Write `model` as a ling-jax checkpoint (orbax params + config.json); `load` restores it onto any mesh."""
    from conversion.orbax_io import save_params

    return save_params(path, model.cfg, model.params, force=force)


def _specs_for(cfg: LingConfig, params: Any) -> Any:
    """param_specs(cfg) with or without the MTP entry as `params` has it; a ValueError naming any other mismatch."""
    if not isinstance(params, dict):
        raise ValueError(f"params must be the params pytree (a dict shaped like param_specs(cfg)), not "
                         f"{type(params).__name__}")
    specs = param_specs(cfg, with_mtp="mtp" in params)
    want = {tuple(_key(k) for k in p): s.shape for p, s in jax.tree_util.tree_flatten_with_path(specs,
                                                                                                 is_leaf=is_spec)[0]}
    got = {tuple(_key(k) for k in p): tuple(jnp.shape(a)) for p, a in jax.tree_util.tree_flatten_with_path(params)[0]}
    problems = ([f"missing {_dotted(p)}" for p in want if p not in got]
                + [f"unexpected {_dotted(p)}" for p in got if p not in want]
                + [f"{_dotted(p)}: expected {list(want[p])}, found {list(got[p])}" for p in want
                   if p in got and got[p] != want[p]])
    if problems:
        raise ValueError(f"params do not match param_specs of the config ({len(problems)} problems): "
                         + "; ".join(problems[:10]) + "; load them with the config they were converted with")
    return specs


def _as_param(array, spec) -> nnx.Param:
    # The arrays arrive placed (param_shardings, or one device): the axes are metadata, not a request to reshard.
    return nnx.Param(array, out_sharding=spec.axes, eager_sharding=False)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _value(v):
    return v.get_value() if _is_variable(v) else v


def _values(tree):
    return jax.tree.map(_value, tree, is_leaf=_is_variable)


def _key(k) -> Any:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return getattr(k, attr)
    raise TypeError(f"unexpected pytree key {k!r}")


def _dotted(path) -> str:
    return ".".join(map(str, path))
