"""gqadrv on JAX arrays: JAX in -> JAX out through DLPack (JAX arrays are immutable, so no out=)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import require_gpu  # noqa: E402

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to CuPy too


def main():
    require_gpu("jax_interop")
    import jax
    import jax.numpy as jnp
    import numpy as np

    import gqadrv

    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    q = jax.random.normal(k1, (2, 16, 128), dtype=jnp.float16)
    kv = jax.random.normal(k2, (2, 2, 4, 512, 128), dtype=jnp.float16)
    lengths = jnp.asarray([512, 100], dtype=jnp.int32)
    out = gqadrv.gqa_decode(q, kv, lengths, q_scale=0.8)
    ref = gqadrv.gqa_decode_reference(np.asarray(q), np.asarray(kv), np.asarray(lengths), 0.8)
    err = float(np.max(np.abs(np.asarray(out).astype(np.float64) - ref)))
    print(f"JAX in -> {type(out).__name__} out on {out.devices()}, max |err| vs float64 oracle {err:.2e}")
    return 0 if err < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
