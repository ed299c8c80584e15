import jax, jax.numpy as jnp
@jax.jit
def f(a, b, c):
    s = lambda r: jax.scipy.linalg.solve_triangular(a, r, lower=True, unit_diagonal=True)
    return s(b).sum() + s(c).sum()
a = jnp.tril(jnp.ones((4, 16, 2, 64, 64))) * 0.01 + jnp.eye(64)
b = jnp.ones((4, 16, 2, 64, 72)); c = jnp.ones((4, 16, 2, 64, 80))
for i in range(200):
    f(a, b + i, c).block_until_ready()
print("ok", jax.__version__)
