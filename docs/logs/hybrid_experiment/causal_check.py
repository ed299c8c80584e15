"""Does a position's output depend on later tokens? Logits at positions < t for a row and for
the same row with tokens from t on replaced."""
import sys
import jax, jax.numpy as jnp, numpy as np
import jaxllm
model = jaxllm.load_model(sys.argv[1])
rng = np.random.default_rng(0)
x = rng.integers(32, 127, (1, 256)).astype(np.int32)
y = x.copy(); t = int(sys.argv[2]); y[:, t:] = rng.integers(32, 127, (1, 256 - t))
lx = np.asarray(model(jnp.asarray(x))[0] if isinstance(model(jnp.asarray(x)), tuple) else model(jnp.asarray(x)))
out = model(jnp.asarray(y)); ly = np.asarray(out[0] if isinstance(out, tuple) else out)
print("max |logit diff| before t:", float(np.abs(lx[:, :t] - ly[:, :t]).max()), " at/after t:", float(np.abs(lx[:, t:] - ly[:, t:]).max()))
