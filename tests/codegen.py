"""The XLA:CPU code generation the suite compiles with, and the default it pins where a test
checks a property of the code users run.

The suite compiles at LLVM optimization level 0 without the expensive passes
(:data:`SUITE_CODEGEN`, set for every process of a run by ``conftest.py`` through
``XLA_FLAGS``): it compiles hundreds of small programs and runs each a few times, so the
backend's optimization costs more than it saves (about a fifth of the suite's CPU time). The HLO
passes, the partitioner and the collectives are the same at every level, so replica identity,
wire bytes and the trained values are checked as they are. What changes is the floating-point
code LLVM emits (e.g. whether a multiply-add is contracted into an FMA): a test that asserts
two *different* programs agree bit for bit (a Pallas kernel and its XLA reference) compiles both
at :data:`DEFAULT_CODEGEN` with :func:`at_default_codegen`; at level 0, 8 of the 10
dequantize-accumulate cases differ in up to 2.8 % of the elements on jax 0.12. So does a
regression test of a crash that was in the default codegen (jaxlib 0.10's XLA:CPU dot).
"""

#: What the suite compiles with (``conftest.py`` passes it to every process as ``XLA_FLAGS``).
SUITE_CODEGEN = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}

#: XLA's defaults for the same options (``tests/test_kernels.py`` checks they are).
DEFAULT_CODEGEN = {"xla_backend_optimization_level": 3,
                   "xla_llvm_disable_expensive_passes": False}


def xla_flags(options: dict) -> str:
    """``options`` as ``XLA_FLAGS`` text: ``--name=value`` each, booleans lower case."""
    return " ".join(f"--{k}={str(v).lower() if isinstance(v, bool) else v}"
                    for k, v in options.items())


def at_default_codegen(fn, *args, static_argnums=()):
    """``fn(*args)`` jitted and compiled at XLA's default code generation (not the suite's).

    Args:
      fn: the function.
      *args: its arguments (``None`` allowed: an absent optional array).
      static_argnums: positions of hashable static arguments, as ``jax.jit``'s.

    Returns:
      ``fn(*args)``.
    """
    import jax  # not at import: conftest imports this module before JAX initialises

    compiled = jax.jit(fn, static_argnums=static_argnums).lower(*args).compile(DEFAULT_CODEGEN)
    return compiled(*(a for i, a in enumerate(args) if i not in static_argnums))
