"""Fused kernels of the speculative round. Each op package has `reference.py` (jnp oracle and CPU path),
`pallas.py` (pl.pallas_call: Triton on GPU, interpret mode on CPU) and `api.py` (`implementation=`
"xla" | "pallas" | "auto"; auto = the Pallas kernel on GPU where it was measured faster, else XLA)."""
from pjax.kernels._dispatch import IMPLEMENTATIONS  # noqa: E402

__all__ = ["IMPLEMENTATIONS"]
