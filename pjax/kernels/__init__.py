"""Fused kernels of the speculative round. Each op package has `reference.py` (jnp oracle and CPU path),
`pallas.py` (pl.pallas_call: Triton on GPU, interpret mode on CPU), `config.py` (the kernel's tuning values) and
`api.py` (the public op). Every op takes `implementation=` one of IMPLEMENTATIONS ("xla" | "pallas" | "auto"; the
contract is in `pjax.kernels.dispatch`); hardware sizes come from `pjax.kernels.hardware`."""
from pjax.kernels.dispatch import IMPLEMENTATIONS

__all__ = ["IMPLEMENTATIONS"]
